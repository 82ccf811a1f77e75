# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled core of :class:`kvbm_runtime.pool.BlockPool`: the block slot, the handles, the
inactive set and the pool's hot batch loops.

* :class:`Block` — a physical block slot (C fields; ``kvbm_runtime.block`` re-exports it).
* :class:`MutableBlock` / :class:`ImmutableBlock` — the handles engines hold, extension
  types whose "dropped while live" rule (give the block back) runs in C at deallocation,
  not as a Python ``__del__`` (that finalizer was ~0.1 µs per block of a batch call;
  ``kvbm_runtime.block`` documents the handles).
* :class:`InactiveSet` — the frequency-aware multi-level LRU of inactive blocks as
  intrusive doubly linked lists over C arrays indexed by block id (no hashing, no
  ``OrderedDict`` entry per block).
* :func:`allocate_complete`, :func:`register_blocks`, :func:`release_blocks`,
  :func:`match_blocks` — the per-block loops of the pool's batch calls (lock held by the
  caller), everything else (errors, undo, dedup, duplicates, events) stays in ``pool.py``.

Finalizers: a handle or pin dropped in a reference cycle is given back by the cycle
collector, which Python 3.11 runs inside an allocation and 3.12+ at the next eval-breaker
check (a Python call or loop): either way inside a batch call of the pool, on the thread
that holds its re-entrant lock, so the finalizer's give-back (or any ``__del__`` or
``gc.callbacks`` hook that re-enters the pool) sees the pool as it is at that point.  Every
state change here that touches more than one place (a block's state and ref count, the
Reset list, the inactive set, the registry, the duplicate copies) therefore runs in C with
no Python frame and no allocation of a tracked object in between: at any point where
Python code can run, counters and lists agree.  ``pool.py`` calls these functions for
every such change (never a Python sequence of them).

The semantics are those of :mod:`kvbm_runtime.pool_reference` (the executable
specification, same functions and same ``InactiveSet`` API in plain Python);
``tests/unit/test_runtime_pool_core_diff.py`` drives pools on either core through the same
random operations and checks them equal (blocks, handles, eviction order, events).
"""

cimport cython
from cpython.dict cimport PyDict_SetDefault
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from libc.stdint cimport int8_t, int32_t

import numpy as np

# BlockState, BlockMeta and WeakBlock come from kvbm_runtime.block_state (kvbm_runtime.block
# re-exports them with the classes below)
import kvbm_runtime.block_state as _blockmod
from kvbm_runtime.errors import BlockStateError, ConsumedHandleError
from kvbm_runtime.hashing import chain_hash, local_hash

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL

_BlockState = _blockmod.BlockState
_BlockMeta = _blockmod.BlockMeta
cdef object _RESET = _BlockState.RESET
cdef object _PARTIAL = _BlockState.PARTIAL
cdef object _COMPLETE = _BlockState.COMPLETE
cdef object _REGISTERED = _BlockState.REGISTERED
cdef tuple _EMPTY = ()


@cython.final
cdef class Block:
    """A physical block slot of a pool; engines never hold it directly, only handles.

    Attributes:
        block_id: index in the pool's layout.
        state: lifecycle state (``BlockState``).
        generation: +1 every time the block returns to Reset (invalidates weak handles).
        salt: salt hash of a Partial block (``init_sequence``); a Complete or Registered
            block's salt is ``meta.salt``.
        parent: metadata of the parent block (``None`` for the first block of a sequence).
        tokens: token ids appended while Partial (an empty tuple when none were).
        meta: identity once Complete / Registered.
        ref_count: live :class:`ImmutableBlock` handles (Registered only).
        frequency: uses since registration (register, dedup hit, match).
    """

    cdef public Py_ssize_t block_id
    cdef public object state
    cdef public long long generation
    cdef public object salt
    cdef public object parent
    cdef public object tokens
    cdef public object meta
    cdef public Py_ssize_t ref_count
    cdef public Py_ssize_t frequency

    def __init__(self, Py_ssize_t block_id):
        self.block_id = block_id
        self.generation = 0
        self._empty()

    cdef void _empty(self) noexcept:
        self.state = _RESET
        self.salt = None
        self.parent = None
        self.tokens = _EMPTY
        self.meta = None
        self.ref_count = 0
        self.frequency = 0

    def clear(self):
        """Back to Reset (the pool calls this; bumps the generation)."""
        self.generation += 1
        self._empty()

    def __repr__(self):
        return f"Block(id={self.block_id}, {self.state.value}, gen={self.generation}, refs={self.ref_count})"


@cython.no_gc_clear
@cython.freelist(128)
@cython.auto_pickle(False)
cdef class _Handle:
    """Common part of the handles: the pool, the block and a live (not consumed) flag.

    Tracked by the cycle collector (a cycle can go through the pool: an event sink or an
    engine object that keeps handles of the pool it is the sink of must not keep the pool
    and its KV memory alive forever), but never cleared by it (``no_gc_clear``): the
    collector breaks such a cycle elsewhere (the pool's or the sink's attributes), so a
    handle always reaches its deallocation with its pool and block and can give them back
    (a finalizer would run before any clearing too, but costs a Python call per handle).
    Handles compare and hash by identity.  Only pools make them (:func:`new_mutable`,
    :func:`new_immutable`, with the reference they stand for): calling a handle class
    raises ``TypeError`` (a hand-built handle would give back a block or a reference the
    pool never handed out).
    """

    cdef public object _pool
    cdef readonly Block _block  # never None: the methods and the loops read its C fields
    cdef public bint _live

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} handles are made by their pool, not built by hand")

    cdef Block _get(self):
        if not self._live or self._block is None:  # (None: an instance made through __new__)
            raise ConsumedHandleError(f"{type(self).__name__} of block {self._id()} was already consumed")
        return self._block

    cdef str _id(self):
        return "?" if self._block is None else str(self._block.block_id)

    @property
    def consumed(self):
        """True once a transition or release consumed this handle."""
        return not self._live

    @property
    def block_id(self):
        """Index of the block in its pool's layout."""
        return self._get().block_id

    @property
    def tier(self):
        """Tier name of the owning pool (``"g1"``, ``"g2"``)."""
        return self._pool.tier

    def view(self):
        """Typed ``[num_layers, outer_dim, page_size, inner_dim]`` view of the block's data
        (a ``torch.Tensor``)."""
        return self._pool.layout.block_view(self._get().block_id)

    def __reduce__(self):
        # a copy would be a second live handle the pool does not count (a mutable block
        # given back twice, a reference dropped that was never taken): refused, as are
        # copy.copy / copy.deepcopy / pickle, which go through here
        raise TypeError(f"{type(self).__name__} handles cannot be copied or pickled")

    def __copy__(self):
        self.__reduce__()

    def __deepcopy__(self, memo):
        self.__reduce__()

    def __dealloc__(self):
        # A live handle dropped: a mutable one's block goes back to the Reset list, a
        # strong one's reference is given back (the last makes the block inactive).  In C
        # at deallocation, not a Python __del__; errors cannot propagate from here (a
        # half-built handle, interpreter shutdown, the pool gone).
        if not self._live or self._pool is None or self._block is None:
            return
        self._live = False
        try:
            if isinstance(self, MutableBlock):
                self._pool._reset_block(self._block)
            else:
                self._pool._release(self._block)
        except BaseException:
            pass


cdef inline _Handle _live_handle(_Handle h, object pool, Block block):
    h._pool = pool
    h._block = block
    h._live = True
    return h


cdef inline MutableBlock _new_mutable(object pool, Block block):
    return <MutableBlock>_live_handle(MutableBlock.__new__(MutableBlock), pool, block)


cdef inline ImmutableBlock _new_immutable(object pool, Block block):
    return <ImmutableBlock>_live_handle(ImmutableBlock.__new__(ImmutableBlock), pool, block)


def new_mutable(pool, Block block not None):
    """A live :class:`MutableBlock` of ``pool`` on ``block`` (pools only: the caller owns
    the block, e.g. just taken off the Reset list)."""
    return _new_mutable(pool, block)


def new_immutable(pool, Block block not None):
    """A live :class:`ImmutableBlock` of ``pool`` on ``block`` (pools only: the caller has
    just taken the reference it stands for)."""
    return _new_immutable(pool, block)


@cython.final
@cython.no_gc_clear
cdef class MutableBlock(_Handle):
    """Exclusive handle on a Reset, Partial or Complete block (see ``kvbm_runtime.block``)."""

    @property
    def state(self):
        """Current state of the block (``BlockState``)."""
        return self._get().state

    @property
    def tokens(self):
        """Token ids appended so far (a tuple)."""
        return tuple(self._get().tokens)

    @property
    def meta(self):
        """Identity once Complete, else ``None``."""
        return self._get().meta

    @property
    def sequence_hash(self):
        """Sequence hash once Complete, else ``None``."""
        meta = self._get().meta
        return None if meta is None else meta.sequence_hash

    cdef MutableBlock _transition(self, Block block):
        self._live = False
        return _new_mutable(self._pool, block)

    def init_sequence(self, salt, parent=None):
        """Reset → Partial: start a block of a sequence under ``salt``.

        Args:
            salt: salt hash (``hashing.salt_hash``) seeding the local hash.
            parent: identity (``BlockMeta``) of the previous full block of the sequence;
                ``None`` for the first block.  Must have been produced under the same salt.

        Returns:
            The new (Partial) handle; this one is consumed.

        Raises:
            BlockStateError: the block is not Reset, or ``parent`` has another salt.
            ConsumedHandleError: this handle was consumed.
        """
        cdef Block block = self._get()
        if block.state is not _RESET:
            raise BlockStateError(f"init_sequence needs a Reset block, block {block.block_id} is {block.state.value}")
        if parent is not None and parent.salt != salt:
            raise BlockStateError("parent block was hashed under another salt")
        block.salt = salt
        block.parent = parent
        block.tokens = []
        block.state = _PARTIAL
        return self._transition(block)

    def append_tokens(self, tokens):
        """Append token ids (a sequence of ints or an array) to a Partial block (not a
        transition: the handle stays valid).

        Returns:
            Free token slots left.

        Raises:
            BlockStateError: the block is not Partial, or the tokens would overflow it
                (nothing is appended then).
        """
        cdef Block block = self._get()
        if block.state is not _PARTIAL:
            raise BlockStateError(f"append_tokens needs a Partial block, block {block.block_id} is {block.state.value}")
        items = [int(t) for t in np.asarray(tokens).reshape(-1)]
        room = self._pool.page_size - len(block.tokens)
        if len(items) > room:
            raise BlockStateError(f"{len(items)} tokens do not fit: block {block.block_id} has room for {room}")
        block.tokens.extend(items)
        return room - len(items)

    def commit(self):
        """Partial → Complete: the block must be full; computes its sequence hash.

        Returns:
            The new (Complete) handle; this one is consumed.

        Raises:
            BlockStateError: not Partial, or fewer than ``page_size`` tokens (partial
                blocks are never registered, case C10).
        """
        cdef Block block = self._get()
        if block.state is not _PARTIAL:
            raise BlockStateError(f"commit needs a Partial block, block {block.block_id} is {block.state.value}")
        if len(block.tokens) != self._pool.page_size:
            raise BlockStateError(
                f"commit needs a full block: {len(block.tokens)} of {self._pool.page_size} tokens"
            )
        parent = block.parent
        seq = chain_hash(None if parent is None else parent.sequence_hash, local_hash(block.tokens, block.salt))
        block.meta = _BlockMeta(
            sequence_hash=seq,
            parent_hash=None if parent is None else parent.sequence_hash,
            prefix_hash=seq if parent is None else parent.prefix_hash,
            salt=block.salt,
        )
        block.state = _COMPLETE
        return self._transition(block)

    def init_from(self, meta):
        """Reset → Complete with a known identity (``BlockMeta``; the block is a copy of a
        block of another tier, e.g. onboarding G2 → G1 or offloading G1 → G2).

        The caller copies the data into :meth:`view` before registering.

        Raises:
            BlockStateError: the block is not Reset.
        """
        cdef Block block = self._get()
        if block.state is not _RESET:
            raise BlockStateError(f"init_from needs a Reset block, block {block.block_id} is {block.state.value}")
        block.salt = meta.salt
        block.meta = meta
        block.state = _COMPLETE
        return self._transition(block)

    def release(self):
        """Give the block back to the pool's Reset list (consumes the handle).

        Raises:
            ConsumedHandleError: this handle was consumed.
        """
        cdef Block block
        pool = self._pool
        if pool is None:
            self._get()  # an instance made through __new__: raises
        with pool._lock:  # consumed under the lock (see ImmutableBlock.release)
            block = self._get()
            self._live = False
            pool._reset_block(block)

    def __repr__(self):
        state = "consumed" if not self._live or self._block is None else self._block.state.value
        return f"MutableBlock(tier={getattr(self._pool, 'tier', None)}, id={self._id()}, {state})"


@cython.final
@cython.no_gc_clear
cdef class ImmutableBlock(_Handle):
    """Strong reference to a Registered block (see ``kvbm_runtime.block``)."""

    @property
    def meta(self):
        """Identity of the block (``BlockMeta``)."""
        return self._get().meta

    @property
    def sequence_hash(self):
        """Sequence hash of the block."""
        return self._get().meta.sequence_hash

    def clone(self):
        """Another strong reference to the same block."""
        cdef Block block = self._get()
        self._pool._acquire(block, touch=False)
        return _new_immutable(self._pool, block)

    def weak(self):
        """A weak reference (``WeakBlock``); this strong handle stays valid."""
        cdef Block block = self._get()
        return _blockmod.WeakBlock(self._pool, block, block.generation, block.meta.sequence_hash)

    def downgrade(self):
        """Strong → weak: returns a weak handle and releases (consumes) this one."""
        weak = self.weak()
        self.release()
        return weak

    def release(self):
        """Drop this strong reference (consumes the handle); the last one makes the
        block inactive (still matchable, evictable).

        Raises:
            ConsumedHandleError: this handle was consumed.
        """
        cdef Block block
        pool = self._pool
        if pool is None:
            self._get()  # an instance made through __new__: raises
        # The handle is checked and consumed under the pool's lock: a batch that fails part
        # way (release_blocks, downgrade_many, register_blocks) makes its handles live again
        # under that lock, so a release outside it could see such a handle consumed, raise,
        # and leave it live with its reference never given back.
        lock = pool._lock
        lock.acquire()
        try:
            block = self._get()
            self._live = False
            if type(pool._inactive) is InactiveSet:  # a pool on this core: no Python frame
                _release_one(pool, block)
            else:
                pool._release(block)
        finally:
            lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._live:
            self.release()

    def __repr__(self):
        if not self._live or self._block is None:
            return f"ImmutableBlock(tier={getattr(self._pool, 'tier', None)}, id={self._id()}, consumed)"
        return f"ImmutableBlock(tier={self._pool.tier}, id={self._block.block_id}, hash={self.sequence_hash:#018x})"


# ---------------------------------------------------------------------------- inactive set

cdef enum:
    _LEVELS = 4


cdef inline int _level_of(Py_ssize_t f) noexcept:
    """Frequency class: <= 1 → 0, 2–3 → 1, 4–7 → 2, >= 8 → 3."""
    return 0 if f < 2 else (1 if f < 4 else (2 if f < 8 else 3))


@cython.final
@cython.no_gc_clear
cdef class InactiveSet:
    """Multi-level LRU of the inactive registered blocks of one pool (the blocks of
    ``blocks``, indexed by ``block_id``).

    Level ``k`` holds blocks of frequency class ``k`` (1, 2–3, 4–7, ≥ 8 uses) in recency
    order, as a doubly linked list through C arrays; a block's level is recorded when it is
    added (its frequency does not change while it is inactive).  Eviction takes the least
    recently used block of the lowest non-empty level.  Every operation is O(1) except
    :meth:`order`.

    Never cleared by the cycle collector (``no_gc_clear``): ``blocks`` is read without a
    check by the C loops, so a finalizer running while a cycle through a pool is being
    collected must still find it in place.
    """

    cdef readonly tuple blocks
    cdef Py_ssize_t n
    cdef int32_t *prev
    cdef int32_t *nxt
    cdef int8_t *lvl
    cdef int32_t head[_LEVELS]
    cdef int32_t tail[_LEVELS]
    cdef Py_ssize_t count[_LEVELS]

    def __cinit__(self, blocks):
        blocks = tuple(blocks)  # its own snapshot: the C arrays are indexed by its length
        cdef Py_ssize_t i, n = len(blocks)
        if n >= 0x7FFFFFFF:
            raise ValueError(f"too many blocks for an InactiveSet: {n}")
        self.blocks = blocks
        self.n = n
        self.prev = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
        self.nxt = <int32_t*>PyMem_Malloc(max(n, 1) * sizeof(int32_t))
        self.lvl = <int8_t*>PyMem_Malloc(max(n, 1) * sizeof(int8_t))
        if self.prev == NULL or self.nxt == NULL or self.lvl == NULL:
            raise MemoryError()
        for i in range(n):
            if type(blocks[i]) is not Block or (<Block>blocks[i]).block_id != i:
                raise ValueError(f"blocks[{i}] is not the Block of id {i}")
            self.prev[i] = -1
            self.nxt[i] = -1
            self.lvl[i] = -1
        for i in range(_LEVELS):
            self.head[i] = -1
            self.tail[i] = -1
            self.count[i] = 0

    def __dealloc__(self):
        PyMem_Free(self.prev)
        PyMem_Free(self.nxt)
        PyMem_Free(self.lvl)

    cdef inline Py_ssize_t _id(self, Block b) except -1:
        """``b``'s id, checked to be one of this set's blocks (no C array is ever indexed
        with a foreign block's id)."""
        cdef Py_ssize_t i = b.block_id
        if i < 0 or i >= self.n or <PyObject*>PyTuple_GET_ITEM(self.blocks, i) is not <PyObject*>b:
            raise ValueError(f"block {i} is not a block of this pool")
        return i

    cdef inline void _push(self, Py_ssize_t i, int k) noexcept:
        """Append block ``i`` (not in the set) at the recent end of level ``k``."""
        cdef int32_t t = self.tail[k]
        self.lvl[i] = k
        self.prev[i] = t
        self.nxt[i] = -1
        if t < 0:
            self.head[k] = <int32_t>i
        else:
            self.nxt[t] = <int32_t>i
        self.tail[k] = <int32_t>i
        self.count[k] += 1

    cdef inline void _unlink(self, Py_ssize_t i) noexcept:
        """Take block ``i`` (in the set) out of its level."""
        cdef int k = self.lvl[i]
        cdef int32_t p = self.prev[i], q = self.nxt[i]
        if p < 0:
            self.head[k] = q
        else:
            self.nxt[p] = q
        if q < 0:
            self.tail[k] = p
        else:
            self.prev[q] = p
        self.lvl[i] = -1
        self.count[k] -= 1

    cdef inline int _add(self, Block b) except -1:
        cdef Py_ssize_t i = self._id(b)
        if self.lvl[i] < 0:
            self._push(i, _level_of(b.frequency))
        return 0

    cdef inline int _discard(self, Block b) except -1:
        cdef Py_ssize_t i = self._id(b)
        if self.lvl[i] < 0:
            raise KeyError(b)
        self._unlink(i)
        return 0

    cdef inline Py_ssize_t _pop(self) noexcept:
        """Id of the next victim, taken out; -1 when the set is empty."""
        cdef int k
        cdef Py_ssize_t i
        for k in range(_LEVELS):
            i = self.head[k]
            if i >= 0:
                self._unlink(i)
                return i
        return -1

    def add(self, Block b not None):
        """Insert an inactive block at the recent end of its frequency level (nothing
        changes if it is in the set already).

        Raises:
            ValueError: ``b`` is not a block of this set's pool.
        """
        self._add(b)

    def discard(self, Block b not None):
        """Take an inactive block out.

        Raises:
            KeyError: ``b`` is not in the set.
            ValueError: ``b`` is not a block of this set's pool.
        """
        self._discard(b)

    def extend(self, blocks):
        """:meth:`add` each of ``blocks`` (an iterable of blocks), in order."""
        for b in blocks:
            self._add(b)

    def __contains__(self, b):
        if type(b) is not Block:
            return False
        cdef Py_ssize_t i = (<Block>b).block_id
        return 0 <= i < self.n and <PyObject*>PyTuple_GET_ITEM(self.blocks, i) is <PyObject*>b and self.lvl[i] >= 0

    def pop_victim(self):
        """The next victim (least recently used block of the lowest non-empty level),
        taken out of the set; ``None`` when the set is empty."""
        cdef Py_ssize_t i = self._pop()
        return None if i < 0 else self.blocks[i]

    def __len__(self):
        return self.count[0] + self.count[1] + self.count[2] + self.count[3]

    def level_len(self, int k):
        """Blocks in level ``k`` (0..3).

        Raises:
            IndexError: ``k`` is not 0..3.
        """
        if k < 0 or k >= _LEVELS:
            raise IndexError(f"level {k} is not 0..{_LEVELS - 1}")
        return self.count[k]

    def order(self):
        """Block ids in eviction order."""
        cdef int k
        cdef Py_ssize_t i
        out = []
        for k in range(_LEVELS):
            i = self.head[k]
            while i >= 0:
                out.append(i)
                i = self.nxt[i]
        return out


# ---------------------------------------------------------------------------- hot loops


cdef inline Block _as_block(object obj):
    # checked cast (None too: the loops below read the block's C fields)
    if type(obj) is not Block:
        raise TypeError(f"expected a Block, got {type(obj).__name__}")
    return <Block>obj


cdef inline InactiveSet _inactive_of(object pool):
    inactive = pool._inactive
    if type(inactive) is not InactiveSet:
        raise TypeError(f"pool {pool.tier} does not run on the compiled core")
    return <InactiveSet>inactive


cdef inline tuple _snapshot(object seq):
    # the loops below run Python code (a key's __eq__, a pool method) between items: they
    # index their own immutable copy of the input, never a list another thread may change
    return seq if type(seq) is tuple else tuple(seq)


cdef int _unregister(dict registry, dict dups, Block b, object h) except -1:
    """Take registered block ``b`` (hash ``h``) out of the registry / its duplicate copies,
    in C (no Python frame: ``h`` is an ``int``, blocks compare by identity).  Returns 1 when
    ``b`` was the hash's last copy (a Remove is owed), else 0.  The body of
    ``BlockPool._unregister_copy``."""
    cdef PyObject* cur
    extra = dups.get(h) if dups else None
    cur = PyDict_GetItemWithError(registry, h)
    if cur == <PyObject*>b:
        if not extra:
            del registry[h]
            return 1
        registry[h] = (<list>extra).pop(0)
    else:
        if extra is None:
            raise RuntimeError(f"block {b.block_id} is registered under {h:#x} but the registry does not name it")
        (<list>extra).remove(b)
    if not extra:
        del dups[h]
    return 0


cdef tuple _take(object pool, Py_ssize_t count, tuple ms):
    """``count`` blocks (Reset ones first, then evicted inactive ones, lowest level first),
    each given identity ``ms[i]`` as a Complete block, or (``ms`` is ``None``) left Reset,
    with a ``MutableBlock`` each.  Lock held.  One block at a time: popped, unregistered,
    given its new life and its handle before anything Python can run (the Reset list is
    re-read per block, a finalizer may have changed it).

    Returns:
        ``(handles, removes, evicted)``; fewer handles than ``count`` when the pool ran out
        part-way (only possible when a finalizer re-entered the pool after the room check
        and took blocks): the blocks taken are back on the Reset list then, and the
        Removes owed for the ones evicted are still returned.
    """
    reset = pool._reset
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef tuple blocks = inactive.blocks
    cdef dict registry = pool._registry
    cdef dict dups = pool._dups
    cdef list out = []
    cdef list removes = None
    cdef Py_ssize_t i, j, evicted = 0
    cdef Block b
    cdef _Handle h
    if count > len(reset) + inactive.count[0]:  # level 0 alone does not cover it: count all
        pool._check_room(count)
    popleft = reset.popleft
    for i in range(count):
        if len(reset):
            j = popleft()
            if j < 0 or j >= inactive.n:
                raise RuntimeError(f"{pool.tier}: block id {j} on the Reset list is not a block of this pool")
            b = <Block>PyTuple_GET_ITEM(blocks, j)
        else:
            j = inactive._pop()
            if j < 0:  # ran out part-way: give the blocks taken back (no handle stays live)
                for obj in out:
                    h = <_Handle>obj
                    h._live = False
                    _reset_one(reset, h._block)
                return [], removes, evicted
            b = <Block>PyTuple_GET_ITEM(blocks, j)
            old = b.meta
            if _unregister(registry, dups, b, old.sequence_hash):
                if removes is None:
                    removes = []
                removes.append(old)
            evicted += 1
            b.generation += 1  # a new life: weak handles of the old one are dead
            b._empty()
        if ms is not None:
            b.meta = <object>PyTuple_GET_ITEM(ms, i)
            b.state = _COMPLETE
        out.append(_new_mutable(pool, b))
    return out, removes, evicted


def allocate_complete(pool, metas):
    """The per-block part of ``BlockPool.allocate_complete(metas)`` (lock held): the room
    checked (``pool._check_room`` unless the Reset list and the lowest inactive level
    cover it), then Reset blocks first, then evicted inactive ones (lowest level first),
    each given its identity as a Complete block.

    Returns:
        ``(handles, removes, evicted)``: one Complete ``MutableBlock`` per identity (none
        when the pool ran out part-way, see :func:`_take`), the identities whose Remove is
        owed (a hash's last copy evicted; ``None`` when none is) and the number of blocks
        evicted.

    Raises:
        PoolExhaustedError: from ``pool._check_room`` (nothing allocated or evicted).
    """
    cdef tuple ms = _snapshot(metas)
    return _take(pool, PyTuple_GET_SIZE(ms), ms)


def allocate_reset(pool, Py_ssize_t count):
    """The body of ``BlockPool.allocate(count)`` (lock held): as :func:`allocate_complete`,
    the blocks left Reset (an evicted one is cleared, its generation bumped)."""
    return _take(pool, count, None)


cdef int _reset_one(object reset, Block b) except -1:
    # back to Reset and onto the Reset list, together
    b.generation += 1
    b._empty()
    reset.append(b.block_id)
    return 0


def reset_block(pool, Block block not None):
    """The body of ``BlockPool._reset_block`` (lock held): a block a mutable handle held
    goes back to Reset and onto the Reset list (nothing when it is registered: the handle
    was consumed by its registration)."""
    if block.state is not _REGISTERED:
        _reset_one(pool._reset, block)


def evict_blocks(pool, Py_ssize_t count):
    """The body of ``BlockPool.evict(count)`` (lock held): up to ``count`` inactive blocks
    (all when ``count < 0``), next victim first, each unregistered, cleared and put on the
    Reset list before the next.

    Returns:
        ``(removes, evicted)``: the identities whose Remove is owed, the blocks evicted.
    """
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef dict registry = pool._registry
    cdef dict dups = pool._dups
    reset = pool._reset
    cdef list removes = []
    cdef Py_ssize_t j, n = 0
    cdef Block b
    while count < 0 or n < count:
        j = inactive._pop()
        if j < 0:
            break
        b = <Block>PyTuple_GET_ITEM(inactive.blocks, j)
        old = b.meta
        if _unregister(registry, dups, b, old.sequence_hash):
            removes.append(old)
        _reset_one(reset, b)
        n += 1
    return removes, n


def settle_existing(pool, MutableBlock handle not None, Block existing not None):
    """One input of a register call whose hash ``existing`` already holds (lock held; the
    body of ``BlockPool._settle_existing``): with duplicates allowed its block becomes a
    further registered copy (one reference), else ``existing`` gains one reference (a
    dedup hit) and the input's block goes back to Reset.

    Returns:
        The block the input now stands for.
    """
    cdef Block b = handle._block
    pool._dedup_hits += 1
    if pool.allow_duplicates:
        h = existing.meta.sequence_hash
        dups = <dict>pool._dups
        extra = dups.get(h)
        if extra is None:
            extra = dups[h] = []
        b.state = _REGISTERED
        b.ref_count = 1
        b.frequency = 1
        (<list>extra).append(b)
        return b
    _acquire_one(pool, existing, True)
    _reset_one(pool._reset, b)
    return existing


cdef int _acquire_one(object pool, Block block, bint touch) except -1:
    if block.state is not _REGISTERED:
        raise BlockStateError(f"block {block.block_id} is {block.state.value}, not registered")
    if block.ref_count == 0:
        _inactive_of(pool)._discard(block)
    block.ref_count += 1
    if touch:
        block.frequency += 1
    return 0


def acquire_one(pool, Block block not None, bint touch=True):
    """The body of ``BlockPool._acquire`` (lock held): one more strong reference
    (reactivates an inactive block); ``touch`` counts a use.

    Raises:
        BlockStateError: the block is not registered.
    """
    _acquire_one(pool, block, touch)


def unrelease(pool, handles):
    """The body of ``BlockPool._unrelease`` (lock held): undo the releases of ``handles``
    (live strong handles a failed batch consumed), last first; each block is back to its
    reference count and out of the inactive set, in one step."""
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef tuple hs = _snapshot(handles)
    cdef Py_ssize_t i
    cdef _Handle h
    cdef Block b
    for i in range(PyTuple_GET_SIZE(hs) - 1, -1, -1):
        h = <_Handle>(<object>PyTuple_GET_ITEM(hs, i))
        h._live = True
        b = h._block
        if b.ref_count == 0 and inactive.lvl[b.block_id] >= 0:
            inactive._unlink(inactive._id(b))
        b.ref_count += 1


def counts(pool):
    """``(reset, active, inactive)`` block counts of ``pool`` read together (lock held;
    ``BlockPool.stats``): no finalizer can run between them."""
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef Py_ssize_t active = 0
    cdef Block b
    for obj in inactive.blocks:
        b = <Block>obj
        if b.state is _REGISTERED and b.ref_count > 0:
            active += 1
    return len(pool._reset), active, len(inactive)


def register_blocks(pool, blocks, bint strong=True):
    """The per-block part of ``BlockPool.register_blocks(blocks)`` (``strong``) and of
    ``BlockPool.register_downgrade`` (not ``strong``), lock held: each valid input (a
    live handle of ``pool`` on a Complete block) is consumed; a hash not registered yet is
    registered on the input's block (frequency 1, a Store owed, ref count 1; a strong
    handle, or (not ``strong``) none), one already registered is deferred to the caller.  Stops at the first invalid input.

    Returns:
        ``(out, stores, deferred, bad, error)``: per registered input a strong handle
        (``strong``) or its block (holding one reference, the batch's: the caller drops it
        with :func:`unpin_blocks`), ``None`` for a deferred one; the identities of the
        Stores owed; ``None`` or a list of ``(index, handle, existing block)``; the index
        of the first invalid input (-1: none; the inputs before it were processed, the
        caller undoes them; that input is untouched); the exception its identity raised
        (no ``sequence_hash``, an unhashable one), or ``None``.
    """
    cdef tuple hs = _snapshot(blocks)
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(hs)
    cdef dict registry = pool._registry
    cdef list out = []
    cdef list stores = []
    deferred = None
    cdef _Handle handle
    cdef Block b
    cdef PyObject* existing
    for i in range(n):
        obj = <object>PyTuple_GET_ITEM(hs, i)
        if type(obj) is not MutableBlock:
            return out, stores, deferred, i, None
        handle = <_Handle>obj
        b = handle._block
        if not handle._live or handle._pool is not pool or b is None or b.state is not _COMPLETE:
            return out, stores, deferred, i, None
        meta = b.meta
        try:
            existing = PyDict_SetDefault(registry, meta.sequence_hash, b)
        except Exception as exc:
            return out, stores, deferred, i, exc
        handle._live = False
        if existing == <PyObject*>b:
            b.state = _REGISTERED
            b.frequency = 1
            stores.append(meta)
            # one reference: a strong handle's, or (not ``strong``) the batch's own, which
            # the caller drops (``unpin_blocks``, input order) once the batch is in; never
            # a registered block at ref count 0 outside the inactive set
            b.ref_count = 1
            if strong:
                out.append(_new_immutable(pool, b))
            else:
                out.append(b)
        else:
            if deferred is None:
                deferred = []
            deferred.append((i, handle, <object>existing))
            out.append(None)
    return out, stores, deferred, -1, None


def release_blocks(pool, handles):
    """The per-block part of ``BlockPool.release_blocks(handles)`` (lock held): consume
    each live strong handle (``ImmutableBlock``) of ``pool`` in order, dropping one
    reference on its block; a block whose last reference this was becomes inactive at its
    frequency level.  Stops at the first input that is not a live strong handle of
    ``pool``.

    Returns:
        The number of handles released (``len(handles)`` when all were).
    """
    cdef tuple hs = _snapshot(handles)
    cdef Py_ssize_t i, rc, n = PyTuple_GET_SIZE(hs)
    # (a mutable handle is refused too: it holds no reference; releasing it here would
    # consume it and leave its block neither Reset nor registered)
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef _Handle h
    cdef Block b
    for i in range(n):
        obj = <object>PyTuple_GET_ITEM(hs, i)
        if type(obj) is not ImmutableBlock:
            return i
        h = <_Handle>obj
        if not h._live or h._pool is not pool or h._block is None:
            return i
        b = h._block
        h._live = False
        rc = b.ref_count - 1
        if rc > 0:
            b.ref_count = rc
        elif rc == 0:  # the last strong ref: inactive, at its frequency level
            b.ref_count = 0
            inactive._add(b)
    return n


cdef int _release_one(object pool, Block block) except -1:
    cdef Py_ssize_t rc = block.ref_count - 1
    if rc > 0:
        block.ref_count = rc
    elif rc == 0 and block.state is _REGISTERED:
        block.ref_count = 0
        _inactive_of(pool)._add(block)
    return 0


def release_one(pool, Block block not None):
    """The body of ``BlockPool._release(block)`` (lock held): drop one strong reference;
    the last one makes a registered block inactive."""
    _release_one(pool, block)


cdef list _lookup(object pool, object sequence_hashes, bint prefix):
    cdef dict registry = pool._registry
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef list out = []
    cdef PyObject* found
    cdef Block b
    for h in sequence_hashes:
        found = PyDict_GetItemWithError(registry, h)
        if found == NULL:
            if prefix:
                break
            out.append(None)
            continue
        b = _as_block(<object>found)
        if b.ref_count == 0:  # inactive → active
            inactive._discard(b)
        b.ref_count += 1
        if prefix:
            b.frequency += 1
        out.append(_new_immutable(pool, b))
    return out


def match_blocks(pool, sequence_hashes):
    """The body of ``BlockPool.match_blocks`` (lock held): strong handles for the
    longest registered prefix of ``sequence_hashes`` (an iterable of ints), each hit
    counted as a use."""
    return _lookup(pool, sequence_hashes, True)


def get_many(pool, sequence_hashes):
    """The body of ``BlockPool.get_many`` (lock held): a strong handle for each hash
    registered (no use counted), ``None`` for each miss."""
    return _lookup(pool, sequence_hashes, False)


def upgrade_weaks(pool, weaks, bint strong):
    """The body of ``BlockPool.upgrade_many`` (``strong``) and ``BlockPool.pin_many``
    (lock held): each weak handle whose block is still registered with its identity
    (block, generation, hash) takes one reference and counts one use.

    Returns:
        ``(out, lost, bad)``: per weak handle a strong handle or ``None`` (``strong``), or
        the blocks pinned; the indices of the handles not upgraded (a block evicted or
        reused since, or not a block of ``pool``); the index of the first handle of another
        pool (-1: none; then nothing was done).
    """
    cdef tuple ws = _snapshot(weaks)
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(ws)
    for i in range(n):
        if (<object>PyTuple_GET_ITEM(ws, i))._pool is not pool:
            return None, None, i
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef list out = []
    cdef list lost = []
    cdef Block b
    cdef Py_ssize_t j
    for i in range(n):
        w = <object>PyTuple_GET_ITEM(ws, i)
        bo = w._block
        # a weak handle naming a block that is not one of this pool's (a hand-built or
        # caller-supplied one) only fails to upgrade, like one naming an older life
        j = (<Block>bo).block_id if type(bo) is Block else -1
        if j < 0 or j >= inactive.n or <PyObject*>PyTuple_GET_ITEM(inactive.blocks, j) is not <PyObject*>bo:
            lost.append(i)
            if strong:
                out.append(None)
            continue
        b = <Block>bo
        if b.generation != w._generation or b.state is not _REGISTERED or b.meta.sequence_hash != w.sequence_hash:
            lost.append(i)
            if strong:
                out.append(None)
            continue
        if b.ref_count == 0:
            inactive._discard(b)
        b.ref_count += 1
        b.frequency += 1
        out.append(_new_immutable(pool, b) if strong else b)
    return out, lost, -1


def unpin_blocks(pool, blocks):
    """The body of ``BlockPool.unpin_many`` (lock held): one reference dropped per block
    of ``blocks`` (a list of blocks), in order; a block left with none becomes inactive."""
    cdef InactiveSet inactive = _inactive_of(pool)
    cdef Block b
    cdef Py_ssize_t rc
    for obj in _snapshot(blocks):
        b = _as_block(obj)
        rc = b.ref_count - 1
        b.ref_count = rc
        if rc == 0:
            inactive._add(b)
