# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled core of :class:`advisor.index.prefix_index.PrefixIndex` (the advisor's fold of the KV event log).

State in C, allocated with ``PyMem_Malloc``/``PyMem_Realloc`` (so ``tracemalloc`` counts it):

* ``hm``: a dense array of ``{sequence hash, low 64 bits of the location mask}`` (16 bytes,
  all a lookup reads), and ``recs``, a parallel array of 56-byte records (parent, prefix,
  size, hits, last access, flags and a doubly linked list of the block's indexed
  children); free records form a list through ``next``.
* ``slots``: an open-addressing (linear probing, backward-shift deletion) hash table of
  ``int32`` record numbers keyed by the u64 sequence hash, mixed with the splitmix64
  finalizer after an XOR with a random per-process seed (ids may be small sequential ints;
  hashes from the wire must not be able to pick their slots), load factor at most 1/2.

* ``mem``: per private location bit (a source's ``g1``/``g2``), a growable array of the
  record numbers that got that bit, compacted lazily (entries of records that lost the bit
  or were reused are dropped, duplicates merged) so a new epoch or a Cleared of g1/g2 reads
  that source's blocks only (``private_visits`` counts the entries read).

Python objects only where the data is rare or shared: location names/bits/counts, the
volumes' storers (``h -> source``), orphans and the children of hashes that are not
indexed, the sources, the counters and, for location bits 64 and above, a wide-mask side
table ``h -> mask >> 64`` (a record with such bits carries ``F_WIDE``).

The semantics are those of :class:`advisor.index.reference.ReferencePrefixIndex` (the
executable specification); ``tests/unit/test_advisor_core_diff.py`` checks them equal.
Hot paths (a Store of a new or known block, a duplicate Store, a Remove, lookups and the
wire parser of :meth:`IndexCore.apply_payload`) run in C; rare ones (orphans, forgetting,
Cleared, ``extra_metadata``, the frequency sketch, restarts, stale epochs, wide masks) run
the same algorithm as the reference on these records.
"""

from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from cpython.ref cimport PyObject
from cpython.long cimport PyLong_CheckExact
from libc.stdint cimport uint64_t, uint32_t, int32_t, uint8_t
from libc.string cimport memcmp

import heapq
import os
import sys
from operator import index as _index

from advisor.index.reference import (
    HITS_KEY,
    PARENT_WALK_LIMIT,
    PLACEMENT_KEYS,
    PRIVATE_TIERS,
    STATE_VERSION,
    U64_MAX,
    BlockInfo,
    IndexCounters,
    IndexStateError,
    SourceState,
    _bits,
    _is_private_name,
    _storer_add,
    _storer_tuple,
    _UNKNOWN_STORER,
    is_valid_location,
)
from event_plane.codec import decode_batch
from event_plane.schema import EventType

cdef extern from "Python.h":
    const Py_ssize_t PY_SSIZE_T_MAX
    unsigned long long _as_ull "PyLong_AsUnsignedLongLong"(object)
    PyObject* PyErr_Occurred()
    void PyErr_Clear()
    object PyUnicode_DecodeASCII(const char* s, Py_ssize_t size, const char* errors)

cdef extern from *:
    int __builtin_ctzll(unsigned long long)
    void __builtin_prefetch(const void*)

cdef extern from "Python.h":
    object PySequence_Fast(object, const char*)
    Py_ssize_t PySequence_Fast_GET_SIZE(object)
    PyObject** PySequence_Fast_ITEMS(object)

cdef extern from *:
    """
    /* u64 value of an exact int from its 30-bit digits (CPython 3.11 layout):
       1 = done, 0 = not a u64 (negative or >= 2**64), -1 = use the general path. */
    static inline int kv_exact_u64(PyObject* o, unsigned long long* out) {
    #if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
        if (!PyLong_CheckExact(o)) return -1;
        Py_ssize_t size = Py_SIZE(o);
        const digit* d = ((PyLongObject*)o)->ob_digit;
        switch (size) {
          case 0: *out = 0; return 1;
          case 1: *out = d[0]; return 1;
          case 2: *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 1;
          case 3:
            if (d[2] >> 4) return 0;
            *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30) | ((unsigned long long)d[2] << 60);
            return 1;
          default: return 0;
        }
    #else
        (void)o; (void)out;
        return -1;
    #endif
    }
    """
    int kv_exact_u64(PyObject* o, unsigned long long* out) noexcept

DEF CHUNK = 64
DEF EV_KEEP = 8192  # events of scratch kept between batches (384 KiB)


cdef enum:
    F_LIVE = 1
    F_PARENT = 2
    F_WIDE = 4
    F_MARK = 8         # transient: deduplicating a membership array (never set between calls)

ctypedef struct HM:   # what a lookup reads, in its own dense array (same index as Rec)
    uint64_t h
    uint64_t mask      # location bits 0..63 (bits >= 64 in IndexCore._wide)

ctypedef struct Rec:
    uint64_t parent
    uint64_t prefix
    uint64_t hits
    uint64_t last
    uint32_t size
    uint32_t flags
    int32_t kid        # first indexed child, -1 for none
    int32_t next       # next sibling (or next free record)
    int32_t prev       # previous sibling
    int32_t pad

ctypedef struct Ev:
    uint64_t h
    uint64_t prefix
    uint64_t parent
    uint32_t size
    uint8_t type
    uint8_t has_parent
    int32_t loc        # number of the run of equal storage_location strings
    PyObject* extra    # borrowed, NULL for None

cdef uint64_t M64 = 0xFFFFFFFFFFFFFFFFULL
cdef object PY_M64 = U64_MAX
cdef Py_ssize_t WALK_LIMIT = PARENT_WALK_LIMIT
cdef object _PRIV = PRIVATE_TIERS
cdef object _STORE = EventType.STORE
cdef object _REMOVE = EventType.REMOVE


cdef uint64_t _SEED = int.from_bytes(os.urandom(8), "little")


cdef inline uint64_t _mix(uint64_t x) nogil:
    # Keyed by a random per-process seed: sequence hashes come from the wire, and with the
    # plain (invertible, public) finalizer a publisher can pick hashes whose slots all
    # collide, making every insert and lookup a scan of one probe cluster (a fold of 20,000
    # such Stores took 60x longer; the dict of the reference is not affected).  The seed
    # only moves slots: record order (hashes(), export_state()) does not depend on it.
    x ^= _SEED
    x ^= x >> 30
    x *= 0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= 0x94d049bb133111ebULL
    x ^= x >> 31
    return x


cdef inline int _key(object o, uint64_t* out) except -1:
    """1 and the u64 in ``out`` when ``o`` is an int in [0, 2**64); 0 otherwise (a key that
    can never be indexed).  Unhashable objects raise ``TypeError`` like a dict lookup."""
    if _key_nohash(o, out):
        return 1
    hash(o)
    return 0


cdef inline int _key_nohash(object o, uint64_t* out) except -1:
    """:func:`_key` without the ``hash()`` of a non-int (0 for it).  Like a dict lookup, an
    integral float or an object with ``__index__`` (numpy integers) equal to an indexed
    hash finds it."""
    cdef unsigned long long v
    cdef int got = kv_exact_u64(<PyObject*>o, &v)
    if got >= 0:
        out[0] = v
        return got
    if isinstance(o, int):
        v = _as_ull(o)
        if v == <unsigned long long>-1 and PyErr_Occurred() != NULL:
            PyErr_Clear()
            return 0
        out[0] = v
        return 1
    if isinstance(o, float):
        if o.is_integer() and 0.0 <= o < 18446744073709551616.0:
            out[0] = <uint64_t>(<double>o)
            return 1
        return 0
    if hasattr(type(o), "__index__"):
        try:
            return _key_nohash(_index(o), out)
        except (TypeError, ValueError, OverflowError):
            return 0
    return 0


cdef inline object _located(str source, str sl):
    return f"{source}/{sl}" if sl in _PRIV else sl


cdef inline bint _read_uint(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end, uint64_t* out) nogil:
    """MessagePack unsigned integer (positive fixint, uint 8/16/32/64) at ``pos``."""
    cdef Py_ssize_t i = pos[0]
    cdef unsigned char b
    cdef uint64_t v
    cdef int k, n
    if i >= end:
        return False
    b = p[i]
    if b < 0x80:
        out[0] = b
        pos[0] = i + 1
        return True
    if b == 0xcc:
        n = 1
    elif b == 0xcd:
        n = 2
    elif b == 0xce:
        n = 4
    elif b == 0xcf:
        n = 8
    else:
        return False
    if i + 1 + n > end:
        return False
    v = 0
    for k in range(n):
        v = (v << 8) | p[i + 1 + k]
    out[0] = v
    pos[0] = i + 1 + n
    return True


cdef inline bint _read_str(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end,
                           Py_ssize_t* off, Py_ssize_t* ln) nogil:
    """MessagePack str header at ``pos``: offset and byte length of the string (not checked)."""
    cdef Py_ssize_t i = pos[0]
    cdef unsigned char b
    cdef Py_ssize_t n
    if i >= end:
        return False
    b = p[i]
    if 0xa0 <= b <= 0xbf:
        n = b & 0x1f
        i += 1
    elif b == 0xd9:
        if i + 2 > end:
            return False
        n = p[i + 1]
        i += 2
    elif b == 0xda:
        if i + 3 > end:
            return False
        n = (<Py_ssize_t>p[i + 1] << 8) | p[i + 2]
        i += 3
    elif b == 0xdb:
        if i + 5 > end:
            return False
        n = ((<Py_ssize_t>p[i + 1] << 24) | (<Py_ssize_t>p[i + 2] << 16) | (<Py_ssize_t>p[i + 3] << 8)
             | p[i + 4])
        i += 5
    else:
        return False
    if i + n > end:
        return False
    off[0] = i
    ln[0] = n
    pos[0] = i + n
    return True


cdef inline bint _ascii_1_255(const unsigned char* p, Py_ssize_t off, Py_ssize_t n) nogil:
    """Whether bytes ``p[off:off+n]`` are 1..255 ASCII characters (then also 1..255 code points)."""
    cdef Py_ssize_t k
    if n < 1 or n > 255:
        return False
    for k in range(n):
        if p[off + k] >= 0x80:
            return False
    return True


cdef inline bint _read_array(const unsigned char* p, Py_ssize_t* pos, Py_ssize_t end, Py_ssize_t* n) nogil:
    cdef Py_ssize_t i = pos[0]
    cdef unsigned char b
    if i >= end:
        return False
    b = p[i]
    if 0x90 <= b <= 0x9f:
        n[0] = b & 0x0f
        pos[0] = i + 1
        return True
    if b == 0xdc:
        if i + 3 > end:
            return False
        n[0] = (<Py_ssize_t>p[i + 1] << 8) | p[i + 2]
        pos[0] = i + 3
        return True
    if b == 0xdd:
        if i + 5 > end:
            return False
        n[0] = ((<Py_ssize_t>p[i + 1] << 24) | (<Py_ssize_t>p[i + 2] << 16) | (<Py_ssize_t>p[i + 3] << 8)
                | p[i + 4])
        pos[0] = i + 5
        return True
    return False


cdef class IndexCore:
    """Block table, location bookkeeping and the fold (see the module docstring).

    :class:`advisor.index.prefix_index.PrefixIndex` is the public class (a subclass); use that.
    """

    cdef Rec* recs
    cdef HM* hm
    cdef int32_t nrec          # records used (high-water mark)
    cdef int32_t rcap
    cdef int32_t free_head
    cdef int32_t nlive
    cdef int32_t* slots
    cdef uint64_t smask        # slot count - 1 (a power of two)
    cdef Ev* evs
    cdef Py_ssize_t evcap
    cdef bint folding          # a batch is being folded (guards against re-entry)
    # Membership of private locations (a source's g1/g2): per location bit, the record
    # numbers that got the bit (appended when they do; entries whose record lost the bit
    # since, or is another block now, are dropped lazily by _mem_compact).  So a new epoch
    # or a Cleared of g1/g2 visits that source's blocks only, not the whole table.
    cdef int32_t** mem
    cdef Py_ssize_t* mlen
    cdef Py_ssize_t* mcap
    cdef Py_ssize_t nmem       # location bits the three arrays above cover
    cdef public unsigned long long private_visits
    """Membership entries read to list a private location's blocks (new epochs, Cleared
    of g1/g2, ``blocks_at``): a cumulative count, for tests (not part of the state)."""

    cdef public object frequency
    cdef public object counters
    cdef public dict _waiting   # hash not indexed -> set of its indexed children (orphans)
    cdef public set _orphans
    cdef public dict _loc_bit
    cdef public list _loc_names
    cdef public list _loc_sets
    cdef public list _loc_counts
    cdef public list _free_bits
    cdef public list _touched
    cdef public dict _sources
    cdef public dict _wide      # hash -> mask >> 64 (only records with F_WIDE)

    def __cinit__(self, *args, **kwargs):
        self.rcap = 16
        self.recs = <Rec*>PyMem_Malloc(self.rcap * sizeof(Rec))
        self.hm = <HM*>PyMem_Malloc(self.rcap * sizeof(HM))
        self.slots = <int32_t*>PyMem_Malloc(16 * sizeof(int32_t))
        self.evcap = 0
        self.evs = NULL
        self.folding = False
        self.mem = NULL
        self.mlen = NULL
        self.mcap = NULL
        self.nmem = 0
        if self.recs == NULL or self.slots == NULL or self.hm == NULL:
            raise MemoryError()
        for i in range(16):
            self.slots[i] = -1
        self.smask = 15
        self.nrec = 0
        self.free_head = -1
        self.nlive = 0

    def __dealloc__(self):
        self._mem_free_all()
        PyMem_Free(self.recs)
        PyMem_Free(self.hm)
        PyMem_Free(self.slots)
        PyMem_Free(self.evs)

    def __init__(self, frequency=None):
        cdef uint64_t i
        if self.folding:
            raise RuntimeError("PrefixIndex.__init__ called during a fold of the same index")
        # an empty index, also when __init__ runs again on a used one: the C table is
        # emptied with the Python side (names, wide masks), which its records refer to
        for i in range(self.smask + 1):
            self.slots[i] = -1
        self.nrec = 0
        self.free_head = -1
        self.nlive = 0
        self._mem_free_all()
        self.private_visits = 0
        self.frequency = frequency
        self.counters = IndexCounters()
        self._waiting = {}
        self._orphans = set()
        self._loc_bit = {}
        self._loc_names = []
        self._loc_sets = []
        self._loc_counts = []
        self._free_bits = []
        self._touched = []
        self._sources = {}
        self._wide = {}

    # ------------------------------------------------------------------ table
    cdef inline int32_t _find(self, uint64_t h) noexcept:
        cdef uint64_t i = _mix(h) & self.smask
        cdef int32_t j
        while True:
            j = self.slots[i]
            if j < 0:
                return -1
            if self.hm[j].h == h:
                return j
            i = (i + 1) & self.smask

    cdef int _grow_slots(self) except -1:
        cdef uint64_t cap = (self.smask + 1) * 2
        cdef int32_t* ns = <int32_t*>PyMem_Malloc(cap * sizeof(int32_t))
        cdef uint64_t i, m = cap - 1
        cdef int32_t j
        if ns == NULL:
            raise MemoryError()
        for i in range(cap):
            ns[i] = -1
        for j in range(self.nrec):
            if self.recs[j].flags & F_LIVE:
                i = _mix(self.hm[j].h) & m
                while ns[i] >= 0:
                    i = (i + 1) & m
                ns[i] = j
        PyMem_Free(self.slots)
        self.slots = ns
        self.smask = m
        return 0

    cdef int32_t _insert(self, uint64_t h) except -1:
        """New record for ``h`` (absent): zeroed, live, no children.  May move ``recs``."""
        cdef int32_t j
        cdef int32_t ncap
        cdef Rec* nr
        cdef HM* nh
        cdef Rec* r
        cdef uint64_t i
        if <uint64_t>(self.nlive + 1) * 2 > self.smask + 1:
            self._grow_slots()
        if self.free_head >= 0:
            j = self.free_head
            self.free_head = self.recs[j].next
        else:
            if self.nrec == self.rcap:
                if self.rcap >= 0x7fffffff // 3:
                    raise MemoryError("index is full (2**31 blocks)")
                ncap = self.rcap + (self.rcap >> 1) + 16
                nr = <Rec*>PyMem_Realloc(self.recs, ncap * sizeof(Rec))
                if nr == NULL:
                    raise MemoryError()
                self.recs = nr
                nh = <HM*>PyMem_Realloc(self.hm, ncap * sizeof(HM))
                if nh == NULL:
                    raise MemoryError()
                self.hm = nh
                self.rcap = ncap
            j = self.nrec
            self.nrec += 1
        r = &self.recs[j]
        self.hm[j].h = h
        self.hm[j].mask = 0
        r.parent = 0
        r.prefix = 0
        r.hits = 0
        r.last = 0
        r.size = 0
        r.flags = F_LIVE
        r.kid = -1
        r.next = -1
        r.prev = -1
        r.pad = 0
        i = _mix(h) & self.smask
        while self.slots[i] >= 0:
            i = (i + 1) & self.smask
        self.slots[i] = j
        self.nlive += 1
        return j

    cdef void _delete(self, int32_t j) noexcept:
        """Drop record ``j`` from the table (children links must already be handled)."""
        cdef uint64_t m = self.smask
        cdef uint64_t i = _mix(self.hm[j].h) & m
        cdef uint64_t k, home
        while self.slots[i] != j:
            i = (i + 1) & m
        k = i
        while True:
            k = (k + 1) & m
            if self.slots[k] < 0:
                break
            home = _mix(self.hm[self.slots[k]].h) & m
            if (i <= k and (home <= i or home > k)) or (i > k and home <= i and home > k):
                self.slots[i] = self.slots[k]
                i = k
        self.slots[i] = -1
        self.recs[j].flags = 0
        self.recs[j].next = self.free_head
        self.free_head = j
        self.nlive -= 1

    cdef inline void _link(self, int32_t p, int32_t c) noexcept:
        cdef Rec* recs = self.recs
        cdef int32_t first = recs[p].kid
        recs[c].prev = -1
        recs[c].next = first
        if first >= 0:
            recs[first].prev = c
        recs[p].kid = c

    cdef inline void _unlink(self, int32_t p, int32_t c) noexcept:
        cdef Rec* recs = self.recs
        cdef int32_t a = recs[c].prev, b = recs[c].next
        if a >= 0:
            recs[a].next = b
        elif recs[p].kid == c:
            recs[p].kid = b
        if b >= 0:
            recs[b].prev = a
        recs[c].next = -1
        recs[c].prev = -1

    cdef list _kids(self, int32_t j):
        cdef list out = []
        cdef int32_t k = self.recs[j].kid
        while k >= 0:
            out.append(self.hm[k].h)
            k = self.recs[k].next
        return out

    cdef object _mask(self, int32_t j):
        """Full location mask of record ``j`` (a Python int)."""
        cdef HM* x = &self.hm[j]
        if self.recs[j].flags & F_WIDE:
            return x.mask | (self._wide[x.h] << 64)
        return x.mask

    cdef int _set_mask(self, int32_t j, object m) except -1:
        cdef Rec* r = &self.recs[j]
        cdef object hi = m >> 64
        self.hm[j].mask = <uint64_t>(m & PY_M64)
        if hi:
            self._wide[self.hm[j].h] = hi
            r.flags |= F_WIDE
        elif r.flags & F_WIDE:
            del self._wide[self.hm[j].h]
            r.flags &= ~F_WIDE
        return 0

    cdef inline bint _has_bit(self, int32_t j, Py_ssize_t bit):
        if bit < 64:
            return (self.hm[j].mask >> bit) & 1
        if self.recs[j].flags & F_WIDE:
            return (self._wide[self.hm[j].h] >> (bit - 64)) & 1
        return False

    # ------------------------------------------------------------------ private membership
    cdef void _mem_free_all(self) noexcept:
        cdef Py_ssize_t b
        for b in range(self.nmem):
            PyMem_Free(self.mem[b])
        PyMem_Free(self.mem)
        PyMem_Free(self.mlen)
        PyMem_Free(self.mcap)
        self.mem = NULL
        self.mlen = NULL
        self.mcap = NULL
        self.nmem = 0

    cdef int _mem_cover(self, Py_ssize_t bit) except -1:
        """Grow the per-bit arrays to cover location ``bit``."""
        cdef Py_ssize_t n = self.nmem, b
        cdef Py_ssize_t want = bit + 1 if bit + 1 > 2 * n else 2 * n
        cdef int32_t** nm
        cdef Py_ssize_t* nl
        cdef Py_ssize_t* nc
        if bit < n:
            return 0
        if want < 16:
            want = 16
        nm = <int32_t**>PyMem_Realloc(self.mem, want * sizeof(int32_t*))
        if nm == NULL:
            raise MemoryError()
        self.mem = nm
        nl = <Py_ssize_t*>PyMem_Realloc(self.mlen, want * sizeof(Py_ssize_t))
        if nl == NULL:
            raise MemoryError()
        self.mlen = nl
        nc = <Py_ssize_t*>PyMem_Realloc(self.mcap, want * sizeof(Py_ssize_t))
        if nc == NULL:
            raise MemoryError()
        self.mcap = nc
        for b in range(n, want):
            self.mem[b] = NULL
            self.mlen[b] = 0
            self.mcap[b] = 0
        self.nmem = want
        return 0

    cdef int _mem_push(self, Py_ssize_t bit, int32_t j) except -1:
        """Record ``j`` got private location ``bit``.  Amortized O(1): a full array is
        compacted first and doubled only when still more than half full."""
        cdef int32_t* na
        cdef Py_ssize_t cap
        if bit >= self.nmem:
            self._mem_cover(bit)
        if self.mlen[bit] == self.mcap[bit]:
            if self.mlen[bit]:
                self._mem_compact(bit)
            if self.mlen[bit] * 2 > self.mcap[bit] or self.mcap[bit] == 0:
                cap = self.mcap[bit] * 2 if self.mcap[bit] else 8
                na = <int32_t*>PyMem_Realloc(self.mem[bit], cap * sizeof(int32_t))
                if na == NULL:
                    raise MemoryError()
                self.mem[bit] = na
                self.mcap[bit] = cap
        self.mem[bit][self.mlen[bit]] = j
        self.mlen[bit] += 1
        return 0

    cdef int _mem_compact(self, Py_ssize_t bit) except -1:
        """Keep the entries of live records that hold ``bit``, once each."""
        cdef int32_t* a = self.mem[bit]
        cdef Py_ssize_t i, w = 0, n = self.mlen[bit]
        cdef int32_t j
        cdef Rec* recs = self.recs
        self.private_visits += n
        for i in range(n):
            j = a[i]
            if j < self.nrec and recs[j].flags & F_LIVE and not (recs[j].flags & F_MARK) \
                    and self._has_bit(j, bit):
                recs[j].flags |= F_MARK
                a[w] = j
                w += 1
        for i in range(w):
            recs[a[i]].flags &= ~F_MARK
        self.mlen[bit] = w
        return 0

    cdef void _mem_reset(self, Py_ssize_t bit) noexcept:
        """Location ``bit`` holds no block any more (cleared, or its bit given back)."""
        if bit < self.nmem:
            self.mlen[bit] = 0
            if self.mcap[bit] > 64:
                PyMem_Free(self.mem[bit])
                self.mem[bit] = NULL
                self.mcap[bit] = 0

    def _add_members(self, Py_ssize_t bit, hashes):
        """Record that the blocks ``hashes`` (all indexed) hold private location ``bit``
        (snapshot import, which lists each location's blocks once: O(blocks listed))."""
        cdef uint64_t k
        cdef int32_t j
        for h in hashes:
            if _key(h, &k):
                j = self._find(k)
                if j >= 0:
                    self._mem_push(bit, j)

    # ------------------------------------------------------------------ locations
    cdef Py_ssize_t _bit(self, str location) except -1:
        bit = self._loc_bit.get(location)
        if bit is None:
            held = None if _is_private_name(location) else {}
            if self._free_bits:
                bit = heapq.heappop(self._free_bits)
                self._loc_names[bit] = location
                self._loc_sets[bit] = held
            else:
                bit = len(self._loc_names)
                self._loc_names.append(location)
                self._loc_sets.append(held)
                self._loc_counts.append(0)
            self._loc_bit[location] = bit
            self._touched.append(bit)  # freed again if the batch leaves it empty
        return bit

    def _free_empty_bits(self):
        """Give back the bits of touched locations that hold no block any more (between batches)."""
        counts = self._loc_counts
        names = self._loc_names
        for bit in set(self._touched):
            if counts[bit] == 0 and names[bit]:
                del self._loc_bit[names[bit]]
                names[bit] = ""
                self._loc_sets[bit] = None
                self._mem_reset(bit)
                heapq.heappush(self._free_bits, bit)
        self._touched.clear()

    def _names(self, mask):
        # one step per set bit (a shift per bit position cost O(bits^2) on a wide mask)
        names = self._loc_names
        return frozenset([names[b] for b in _bits(mask)])

    cdef list _held(self, Py_ssize_t bit):
        """Hashes held at location ``bit`` (set copy for volumes, table scan for g1/g2)."""
        cdef Py_ssize_t i
        s = self._loc_sets[bit]
        if s is not None:
            return list(s)
        cdef list out = []
        if bit >= self.nmem:
            return out
        self._mem_compact(bit)
        for i in range(self.mlen[bit]):
            out.append(self.hm[self.mem[bit][i]].h)
        return out

    def _private_mask(self, str source):
        """Bits of ``source``'s own g1/g2 locations (0 for those not seen yet)."""
        m = 0
        for tier in ("g1", "g2"):
            bit = self._loc_bit.get(f"{source}/{tier}")
            if bit is not None:
                m |= 1 << bit
        return m

    cdef _hold(self, Py_ssize_t bit, uint64_t h, str source):
        s = self._loc_sets[bit]
        if s is not None:
            s[h] = source
        self._loc_counts[bit] += 1

    cdef _release(self, Py_ssize_t bit, uint64_t h):
        s = self._loc_sets[bit]
        if s is not None:
            s.pop(h, None)
        self._loc_counts[bit] -= 1
        self._touched.append(bit)

    # ------------------------------------------------------------------ slow paths
    cdef _store(self, str source, uint64_t h, uint64_t prefix, object parent, uint32_t size,
                str storage_location, object extra, uint64_t ts, bint access):
        """One Store (``access=False``: a placement fact only, never a hit)."""
        cdef int32_t j, pj, cj
        cdef uint64_t p
        cdef Rec* r
        c = self.counters
        c.stores += 1
        if parent is not None and parent == h:
            c.self_parent_rejected += 1
            return
        if parent is not None and h in self._waiting and self._find(h) < 0 and self._closes_cycle(h, parent):
            c.parent_cycle_rejected += 1
            return
        private = storage_location in _PRIV
        loc = f"{source}/{storage_location}" if private else storage_location
        bit = self._loc_bit.get(loc)
        if bit is None:
            bit = self._bit(loc)
        flag = 1 << bit
        j = self._find(h)
        if j < 0:
            j = self._insert(h)
            r = &self.recs[j]
            r.prefix = prefix
            r.size = size
            r.last = ts
            if parent is not None:
                p = parent
                r.parent = p
                r.flags |= F_PARENT
                pj = self._find(p)
                if pj < 0:
                    ws = self._waiting.get(parent)
                    if ws is None:
                        self._waiting[parent] = {h}
                    else:
                        ws.add(h)
                    c.orphans += 1
                    self._orphans.add(h)
                else:
                    self._link(pj, j)
            self._set_mask(j, flag)
            self._hold(bit, h, source)
            if self._loc_sets[bit] is None:
                self._mem_push(bit, j)
            kids = self._waiting.pop(h, None)
            if kids is not None:
                for child in kids:
                    cj = self._find(child)
                    self._link(j, cj)
                    if child in self._orphans:
                        self._orphans.discard(child)
                        c.orphans_linked += 1
            hits = _reported_hits(extra)
            if hits:
                self.recs[j].hits = hits
                c.hits = min(c.hits + hits, U64_MAX)
            if self.frequency is not None:
                self.frequency.increment(h, 1 + hits)
            return
        m = self._mask(j)
        if m & flag:
            c.duplicate_stores += 1
            held = self._loc_sets[bit]
            if held is not None:
                held[h] = _storer_add(held[h], source)
            return
        # A known block at a new location: onboarding, another worker, offload or a move.
        self._set_mask(j, m | flag)
        self.recs[j].size = size
        self._hold(bit, h, source)
        if self._loc_sets[bit] is None:
            self._mem_push(bit, j)
        hits = _reported_hits(extra)
        placement_only = not access or (extra is not None and any(k in extra for k in PLACEMENT_KEYS))
        if not placement_only and self._is_access(source, storage_location, m):
            hits += 1
        if hits:
            r = &self.recs[j]
            r.hits = min(r.hits + hits, U64_MAX)
            c.hits = min(c.hits + hits, U64_MAX)
            r.last = ts
            if self.frequency is not None:
                self.frequency.increment(h, hits)

    cdef bint _closes_cycle(self, uint64_t h, uint64_t p):
        """Whether linking new block ``h`` under ``p`` closes a parent cycle: the chain from
        ``p`` reaches ``h`` within ``PARENT_WALK_LIMIT`` links (as the reference)."""
        cdef Py_ssize_t k
        cdef int32_t j
        for k in range(WALK_LIMIT):
            j = self._find(p)
            if j < 0 or not (self.recs[j].flags & F_PARENT):
                return False
            p = self.recs[j].parent
            if p == h:
                return True
        return False

    def _is_access(self, str source, str storage_location, other_mask):
        """Whether a Store of a known block at a new location is a reuse of the block
        (onboarding into ``g1``, or a worker that does not hold it in its own g1/g2)."""
        if storage_location == "g1":
            return True
        return not (other_mask & self._private_mask(source))

    cdef _remove(self, str loc, uint64_t h):
        cdef int32_t j
        c = self.counters
        c.removes += 1
        j = self._find(h)
        bit = self._loc_bit.get(loc)
        if j < 0 or bit is None or not self._has_bit(j, bit):
            c.unknown_removes += 1
            return
        m = self._mask(j) & ~(1 << bit)
        self._set_mask(j, m)
        self._release(bit, h)
        if not m:
            self._forget(j)

    cdef _forget(self, int32_t j):
        """Drop a block no location holds; its indexed children become orphans."""
        cdef Rec* r = &self.recs[j]
        cdef uint64_t h = self.hm[j].h
        cdef int32_t pj, k, nk
        cdef bint has_parent = r.flags & F_PARENT
        cdef uint64_t p = r.parent
        self.counters.forgotten += 1
        if has_parent:
            pj = self._find(p)
            if pj >= 0:
                self._unlink(pj, j)
            else:
                ws = self._waiting.get(p)
                if ws is not None:
                    ws.discard(h)
                    if not ws:
                        del self._waiting[p]
        kids = []
        k = self.recs[j].kid
        while k >= 0:
            kids.append(self.hm[k].h)
            nk = self.recs[k].next
            self.recs[k].next = -1
            self.recs[k].prev = -1
            k = nk
        if self.recs[j].flags & F_WIDE:
            del self._wide[h]
        self._delete(j)
        self._orphans.discard(h)
        if kids:
            self._waiting[h] = set(kids)
            self._orphans.update(kids)

    def _clear_location(self, str loc):
        """Empty location ``loc`` whole (a source's own g1/g2)."""
        cdef int32_t j
        bit = self._loc_bit.get(loc)
        if bit is None:
            return
        hashes = self._held(bit)
        s = self._loc_sets[bit]
        if s is not None:
            s.clear()
        self._loc_counts[bit] = 0
        self._touched.append(bit)
        keep = ~(1 << bit)
        for h in sorted(hashes):  # sorted: forgetting order must not depend on table order
            j = self._find(h)
            m = self._mask(j) & keep
            self._set_mask(j, m)
            if not m:
                self._forget(j)
        if s is None:
            self._mem_reset(bit)

    def _clear_storer(self, str volume, str source):
        """Cleared of ``volume`` from ``source``: ``source`` stops being a storer of each
        block there; blocks with no storer left leave the volume (others' blocks stay)."""
        cdef int32_t j
        bit = self._loc_bit.get(volume)
        if bit is None:
            return
        held = self._loc_sets[bit]
        if held is None:
            return
        gone = []
        for h, st in held.items():
            if st.__class__ is str:
                if st == source:
                    gone.append(h)
            elif source in st:
                rest = st - {source}
                held[h] = next(iter(rest)) if len(rest) == 1 else rest
        if not gone:
            return
        gone.sort()
        for h in gone:
            del held[h]
        self._loc_counts[bit] -= len(gone)
        self._touched.append(bit)
        keep = ~(1 << bit)
        for h in gone:
            j = self._find(h)
            m = self._mask(j) & keep
            self._set_mask(j, m)
            if not m:
                self._forget(j)

    def _drop_private(self, str source):
        for tier in sorted(PRIVATE_TIERS):
            self._clear_location(f"{source}/{tier}")

    def _apply_stale(self, str source, batch):
        """Apply the volume events of a superseded-epoch batch, in order (private ones are
        ignored: that epoch's g1/g2 is gone).  Stores are placement only (no hit)."""
        c = self.counters
        ts = batch.ts_ns
        for ev in batch.events:
            sl = ev.storage_location
            if not is_valid_location(sl):
                c.invalid_locations += 1
                continue
            if sl in _PRIV:
                continue
            c.stale_volume_events += 1
            t = ev.type
            if t == _STORE:
                self._store(source, ev.sequence_hash, ev.prefix_hash, ev.parent_hash, ev.block_size, sl,
                            ev.extra_metadata, ts, False)
            elif t == _REMOVE:
                self._remove(sl, ev.sequence_hash)
            else:
                c.cleared += 1
                self._clear_storer(sl, source)

    # ------------------------------------------------------------------ batches
    cdef void _drop_ev_buffer(self) noexcept:
        """Free the event scratch array (kept between batches only while it is small)."""
        PyMem_Free(self.evs)
        self.evs = NULL
        self.evcap = 0

    cdef Ev* _ev_buffer(self, Py_ssize_t n) except NULL:
        cdef Ev* nb
        if n < 0 or <size_t>n > (<size_t>PY_SSIZE_T_MAX) // sizeof(Ev):
            raise MemoryError(f"a batch of {n} events does not fit in memory")
        if n > self.evcap or self.evs == NULL:
            nb = <Ev*>PyMem_Realloc(self.evs, (n if n > 16 else 16) * sizeof(Ev))
            if nb == NULL:
                raise MemoryError()
            self.evs = nb
            self.evcap = n if n > 16 else 16
        return self.evs

    cdef int _begin(self, str source, object epoch) except -1:
        """1 when a batch of ``source`` at ``epoch`` is of a superseded (retired) epoch,
        else 0 (fold it; :meth:`_fold` handles a new source or a restart)."""
        src = self._sources.get(source)
        if src is None:
            return 0
        if epoch != src.epoch:
            if epoch in src.retired_epochs:
                return 1
        return 0

    def apply_batch(self, batch):
        """Fold one batch (an :class:`event_plane.schema.EventBatch`) into the index.

        Never raises on event content: every anomaly is counted (see :class:`IndexCounters`).
        ``batch.ts_ns`` is the clock used for last access, so the fold is deterministic.
        A Cleared event empties the source's ``g1``/``g2``; for a volume id (global) it
        removes this source from the storers of the volume's blocks, and a block leaves the
        volume when no storer remains (``docs/events.md`` §2.3).  A batch of a superseded
        epoch applies only its volume events.

        Raises:
            ValueError: a field of a (hand-built, not decoded) batch is out of its wire range
                (hashes/epoch/seq/ts_ns u64, block_size u32, type 0..2); nothing is applied.
            RuntimeError: called while a fold of this index is in progress (e.g. from the
                frequency sketch's ``increment``): the fold holds the event scratch array and
                the current location's bit, so it is not re-entrant.
        """
        self._enter()
        try:
            self._apply_batch(batch)
        finally:
            self.folding = False
            if self.evcap > EV_KEEP:
                self._drop_ev_buffer()

    cdef int _enter(self) except -1:
        if self.folding:
            raise RuntimeError("PrefixIndex.apply_batch/apply_payload called during a fold of the same index "
                               "(not re-entrant)")
        self.folding = True
        return 0

    def _apply_batch(self, batch):
        cdef Py_ssize_t n, k, loc = -1
        cdef Ev* e
        cdef Ev* evs
        events = batch.events
        n = len(events)
        evs = self._ev_buffer(n)
        locs = []
        extras = []  # owns every extra_metadata the records point to (borrowed in Ev.extra),
        # so the fold stays valid if Python code it calls (the frequency sketch) mutates the batch
        prev = None
        try:
            for k in range(n):
                ev = events[k]
                e = &evs[k]
                t = ev.type
                if t == 0:
                    e.type = 0
                elif t == 1:
                    e.type = 1
                elif t == 2:
                    e.type = 2
                else:
                    raise ValueError(f"event type {t!r} is not 0, 1 or 2")
                e.h = ev.sequence_hash
                e.prefix = ev.prefix_hash
                p = ev.parent_hash
                if p is None:
                    e.has_parent = 0
                    e.parent = 0
                else:
                    e.has_parent = 1
                    e.parent = p
                e.size = ev.block_size
                sl = ev.storage_location
                if k == 0 or (sl is not prev and sl != prev):
                    if not isinstance(sl, str):
                        raise TypeError(f"storage_location {sl!r} is not a str")
                    locs.append(sl)
                    loc += 1
                    prev = sl
                e.loc = loc
                x = ev.extra_metadata
                if x is None:
                    e.extra = NULL
                else:
                    extras.append(x)
                    e.extra = <PyObject*>x
            ts = <uint64_t>batch.ts_ns
            epoch = <uint64_t>batch.epoch
            seq = <uint64_t>batch.seq
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"batch from {batch.source!r} has a field outside its wire range: {exc}") from exc
        source = sys.intern(batch.source)
        if self._begin(source, batch.epoch):
            self.counters.stale_batches += 1
            self._apply_stale(source, batch)
            if self._touched:
                self._free_empty_bits()
            return
        self._fold(source, epoch, seq, ts, evs, n, locs)

    def apply_payload(self, payload):
        """Fold one KVEvent v1 wire batch (``docs/events.md`` §2) straight from its bytes.

        Equivalent to ``apply_batch(decode_batch(payload))``: the common shape (shortest or
        any unsigned integer encodings, ASCII strings, nil ``extra_metadata``, a known
        epoch) is parsed and folded in one pass over the buffer; anything else (maps,
        non-ASCII strings, restarts and stale epochs, malformed data) goes through
        :func:`event_plane.codec.decode_batch` and :meth:`apply_batch`.

        Args:
            payload: the batch bytes (``bytes``, ``bytearray`` or ``memoryview``).

        Returns:
            The number of events in the batch.

        Raises:
            CodecError: exactly when ``decode_batch(payload)`` raises it (same message);
                nothing is applied then.
            RuntimeError: called during a fold of this index (see :meth:`apply_batch`).
        """
        self._enter()
        try:
            return self._apply_payload(payload, None)
        finally:
            self.folding = False
            if self.evcap > EV_KEEP:
                self._drop_ev_buffer()

    def apply_payload_within(self, payload, Py_ssize_t max_batch_events, Py_ssize_t max_sources,
                             Py_ssize_t max_blocks, Py_ssize_t max_source_blocks):
        """:meth:`apply_payload`, only when the batch has the common shape (see there) and
        plainly fits the state quotas, which it then passes with nothing to count or rewrite
        (``advisor/ingest/quotas.py``, ``QuotaGuard.admit`` without the rate and hits
        checks): at most ``max_batch_events`` events; a known source, or fewer than
        ``max_sources`` known; the source's current epoch; no event metadata; every storage
        location ``g1``, ``g2`` or one the index holds; and room for every event even if each
        were a Store (``len(index) + n <= max_blocks``, the source's ``g1`` + ``g2`` blocks
        ``+ n <= max_source_blocks``).

        Returns:
            The number of events applied, or -1 with nothing applied or counted: the batch
            needs the full check (``QuotaGuard.admit``), which decides it exactly as if this
            method had not been called.

        Raises:
            RuntimeError: called during a fold of this index (see :meth:`apply_batch`).
        """
        self._enter()
        try:
            return self._apply_payload(payload, (max_batch_events, max_sources, max_blocks, max_source_blocks))
        finally:
            self.folding = False
            if self.evcap > EV_KEEP:
                self._drop_ev_buffer()

    cdef bint _within(self, str source, uint64_t epoch, Py_ssize_t n, list locs, tuple limits) except -1:
        """Whether a common-shape batch plainly fits ``limits`` (:meth:`apply_payload_within`)."""
        cdef Py_ssize_t max_events = limits[0], max_sources = limits[1], max_blocks = limits[2]
        cdef Py_ssize_t max_source_blocks = limits[3], held = 0
        if n > max_events:
            return False
        src = self._sources.get(source)
        if src is None:
            if len(self._sources) >= max_sources:
                return False
        elif src.epoch != epoch:
            return False
        for sl in locs:
            if sl not in _PRIV and sl not in self._loc_bit:
                return False
        if self.nlive + n > max_blocks:
            return False
        if src is not None:
            held = self.count_at(f"{source}/g1") + self.count_at(f"{source}/g2")
        return held + n <= max_source_blocks

    def _apply_payload(self, payload, limits):
        cdef const unsigned char[::1] view
        cdef const unsigned char* p
        cdef Py_ssize_t pos = 0, end, n, k, off, ln, loc = -1, prev_off = 0, prev_ln = -1, narr, src_off = 0, src_ln = 0
        cdef uint64_t epoch, seq, ts, v
        cdef Ev* e
        cdef Ev* evs
        cdef unsigned char b
        cdef bint ok = False
        try:
            view = payload
        except (TypeError, ValueError, BufferError):
            if limits is not None:
                return -1
            batch = decode_batch(payload)
            self._apply_batch(batch)
            return len(batch.events)
        p = &view[0] if view.shape[0] else NULL
        end = view.shape[0]
        locs = []
        while True:  # one pass; break = not the common shape
            if end < 1 or p[0] != 0x96:
                break
            pos = 1
            if pos >= end or p[pos] != 0x01:
                break
            pos += 1
            if not _read_str(p, &pos, end, &off, &ln) or not _ascii_1_255(p, off, ln):
                break
            src_off = off
            src_ln = ln
            if not _read_uint(p, &pos, end, &epoch) or not _read_uint(p, &pos, end, &seq) \
                    or not _read_uint(p, &pos, end, &ts):
                break
            if not _read_array(p, &pos, end, &n) or n > (end - pos) // 8:
                break
            evs = self._ev_buffer(n)
            k = 0
            while k < n:
                e = &evs[k]
                if pos + 8 > end:
                    break
                b = p[pos]
                if b != 0x96 and b != 0x97:
                    break
                narr = b & 0x0f
                b = p[pos + 1]
                if b > 2:
                    break
                e.type = b
                pos += 2
                if not _read_uint(p, &pos, end, &e.h) or not _read_uint(p, &pos, end, &e.prefix):
                    break
                if pos < end and p[pos] == 0xc0:
                    e.has_parent = 0
                    e.parent = 0
                    pos += 1
                elif _read_uint(p, &pos, end, &e.parent):
                    e.has_parent = 1
                else:
                    break
                if not _read_uint(p, &pos, end, &v) or v > 0xFFFFFFFFULL:
                    break
                e.size = <uint32_t>v
                if not _read_str(p, &pos, end, &off, &ln):
                    break
                if ln != prev_ln or memcmp(p + off, p + prev_off, ln) != 0:
                    if not _ascii_1_255(p, off, ln):
                        break
                    locs.append(PyUnicode_DecodeASCII(<const char*>(p + off), ln, NULL))
                    loc += 1
                    prev_off = off
                    prev_ln = ln
                e.loc = loc
                e.extra = NULL
                if narr == 7:
                    if pos >= end or p[pos] != 0xc0:
                        break
                    pos += 1
                k += 1
            if k != n or pos != end:
                break
            ok = True
            break
        if not ok:
            if limits is not None:
                return -1
            batch = decode_batch(payload)  # raises CodecError for malformed payloads
            self._apply_batch(batch)
            return len(batch.events)
        source = sys.intern(PyUnicode_DecodeASCII(<const char*>(p + src_off), src_ln, NULL))
        if limits is not None and not self._within(source, epoch, n, locs, limits):
            return -1
        src = self._sources.get(source)
        if src is not None and src.epoch != epoch:  # restart or stale epoch: the general path
            self._apply_batch(decode_batch(payload))
            return n
        self._fold(source, epoch, seq, ts, evs, n, locs)
        return n

    cdef int _fold(self, str source, uint64_t epoch, uint64_t seq, uint64_t ts, Ev* evs, Py_ssize_t n,
                   list locs) except -1:
        """Header bookkeeping and the event loop of a batch of a current (or new) epoch."""
        cdef Py_ssize_t k, cur_loc = -1, bit = 0, delta = 0
        cdef Py_ssize_t n_new = 0, n_dup = 0, n_known = 0, n_rm = 0, n_hits = 0
        cdef uint64_t flag = 0, lo, priv = 0, h
        cdef bint wide_cur = False, priv_wide = False, is_g1 = False, fast
        cdef int32_t j, pj
        cdef Rec* r
        cdef Ev* e
        cdef dict waiting = self._waiting
        cdef list counts = self._loc_counts
        cdef object lset = None
        cdef object cur_sl = None
        cdef object sl, parent_obj, extra_obj
        c = self.counters
        src = self._sources.get(source)
        if src is None:
            src = self._sources[source] = SourceState(epoch=epoch, last_seq=seq)
        elif epoch != src.epoch:
            src.retired_epochs.add(src.epoch)
            src.epoch = epoch
            c.restarts += 1
            self._drop_private(source)
        src.last_seq = seq
        src.batches += 1
        src.events += n
        src.last_ts_ns = ts
        c.batches += 1
        c.events += n
        fast = self.frequency is None
        try:
            for k in range(n):
                e = &evs[k]
                # overlap the table's cache misses: the slot of the event 8 ahead, the likely
                # record of the event 4 ahead
                if k + 8 < n:
                    __builtin_prefetch(&self.slots[_mix(evs[k + 8].h) & self.smask])
                if k + 4 < n:
                    j = self.slots[_mix(evs[k + 4].h) & self.smask]
                    if j >= 0:
                        __builtin_prefetch(&self.hm[j])
                if e.type == 2:
                    sl = locs[e.loc]
                    if not is_valid_location(sl):
                        c.invalid_locations += 1
                        continue
                    if delta:
                        counts[bit] += delta
                        delta = 0
                    c.cleared += 1
                    if sl in _PRIV:
                        self._clear_location(f"{source}/{sl}")
                    else:
                        self._clear_storer(sl, source)
                    continue
                if e.loc != cur_loc:
                    sl = locs[e.loc]
                    if sl != cur_sl:
                        if not is_valid_location(sl):
                            c.invalid_locations += 1
                            continue
                        if delta:
                            counts[bit] += delta
                            delta = 0
                        bit = self._bit(_located(source, sl))
                        if e.type == 1:
                            self._touched.append(bit)
                        if bit < 64:
                            flag = (<uint64_t>1) << bit
                            wide_cur = False
                        else:
                            flag = 0
                            wide_cur = True
                        lset = self._loc_sets[bit]
                        is_g1 = sl == "g1"
                        pm = self._private_mask(source)
                        priv = <uint64_t>(pm & PY_M64)
                        priv_wide = (pm >> 64) != 0
                        cur_sl = sl
                    cur_loc = e.loc
                h = e.h
                if e.type == 0:
                    if not wide_cur:
                        j = self._find(h)
                        if j >= 0:
                            r = &self.recs[j]
                            lo = self.hm[j].mask
                            if lo & flag:
                                if not (e.has_parent and e.parent == h):
                                    n_dup += 1
                                    if lset is not None:
                                        st = lset[h]
                                        if st is not source:
                                            lset[h] = _storer_add(st, source)
                                    continue
                            elif (fast and e.extra == NULL and not (e.has_parent and e.parent == h)
                                  and not (r.flags & F_WIDE) and not priv_wide):
                                self.hm[j].mask = lo | flag
                                if lset is None:
                                    if bit < self.nmem and self.mlen[bit] < self.mcap[bit]:
                                        self.mem[bit][self.mlen[bit]] = j
                                        self.mlen[bit] += 1
                                    else:
                                        self._mem_push(bit, j)
                                r.size = e.size
                                if is_g1 or not (lo & priv):
                                    if r.hits != M64:
                                        r.hits += 1
                                    r.last = ts
                                    n_hits += 1
                                if lset is not None:
                                    lset[h] = source
                                delta += 1
                                n_known += 1
                                continue
                        elif fast and e.extra == NULL and (not waiting or h not in waiting):
                            if not e.has_parent:
                                j = self._insert(h)
                                r = &self.recs[j]
                            elif e.parent != h and (pj := self._find(e.parent)) >= 0:
                                j = self._insert(h)
                                r = &self.recs[j]
                                r.parent = e.parent
                                r.flags = F_LIVE | F_PARENT
                                self._link(pj, j)
                            else:
                                j = -1
                            if j >= 0:
                                if lset is None:
                                    if bit < self.nmem and self.mlen[bit] < self.mcap[bit]:
                                        self.mem[bit][self.mlen[bit]] = j
                                        self.mlen[bit] += 1
                                    else:
                                        self._mem_push(bit, j)
                                r.prefix = e.prefix
                                r.size = e.size
                                self.hm[j].mask = flag
                                r.last = ts
                                if lset is not None:
                                    lset[h] = source
                                delta += 1
                                n_new += 1
                                continue
                    if delta:
                        counts[bit] += delta
                        delta = 0
                    parent_obj = e.parent if e.has_parent else None
                    extra_obj = <object>e.extra if e.extra != NULL else None
                    self._store(source, h, e.prefix, parent_obj, e.size, cur_sl, extra_obj, ts, True)
                else:
                    if not wide_cur:
                        j = self._find(h)
                        if j >= 0:
                            r = &self.recs[j]
                            lo = self.hm[j].mask
                            if lo & flag and (lo != flag or r.flags & F_WIDE):
                                self.hm[j].mask = lo & ~flag
                                if lset is not None:
                                    del lset[h]
                                delta -= 1
                                n_rm += 1
                                continue
                    if delta:
                        counts[bit] += delta
                        delta = 0
                    self._remove(_located(source, cur_sl), h)
        finally:
            # also when Python code the loop calls (the sketch, a str subclass's __ne__, a
            # signal handler) raises: the events folded so far stay consistent (block counts
            # per location match the masks, so no bit is freed while a block still holds it)
            if delta:
                counts[bit] += delta
            if n_new or n_dup or n_known:
                c.stores += n_new + n_dup + n_known
            if n_dup:
                c.duplicate_stores += n_dup
            if n_hits:
                c.hits = min(c.hits + n_hits, U64_MAX)
            if n_rm:
                c.removes += n_rm
            if self._touched:
                self._free_empty_bits()
        return 0

    # ------------------------------------------------------------------ queries
    def __len__(self):
        return self.nlive

    def __contains__(self, h):
        cdef uint64_t k
        return bool(_key(h, &k)) and self._find(k) >= 0

    def block(self, h):
        """Info of block ``h`` (a :class:`BlockInfo`), or ``None`` when no location holds it."""
        cdef uint64_t k
        cdef int32_t j
        if not _key(h, &k):
            return None
        j = self._find(k)
        if j < 0:
            return None
        cdef Rec* r = &self.recs[j]
        return BlockInfo(k, r.parent if r.flags & F_PARENT else None, r.prefix, r.size,
                         self._names(self._mask(j)), r.hits, r.last, k in self._orphans)

    cdef Py_ssize_t _resolve(self, PyObject** items, Py_ssize_t n, int32_t* out, bint* odd) except -1:
        """Record numbers of the leading indexed hashes of ``items[:n]`` (``n <= CHUNK``):
        how many were found.  Prefetches every slot, then every record, so the cache misses
        of one request overlap instead of following each other.

        Runs no Python code (``items`` is the storage of the caller's list, which Python
        code could resize): only exact ints are read here; at the first other item it
        stops and sets ``odd`` (the caller resolves that item with :func:`_key`, holding a
        reference to it, and fetches the list's storage again)."""
        cdef uint64_t keys[CHUNK]
        cdef uint64_t pos[CHUNK]
        cdef Py_ssize_t t, m = n
        cdef uint64_t i, h
        cdef unsigned long long v = 0
        cdef int32_t j, got
        cdef uint64_t smask = self.smask
        cdef int32_t* slots = self.slots
        odd[0] = False
        for t in range(n):
            got = kv_exact_u64(items[t], &v)
            keys[t] = v
            if got < 0:
                if not PyLong_CheckExact(<object>items[t]):
                    odd[0] = True
                    m = t
                    break
                v = _as_ull(<object>items[t])  # an exact int: no Python code runs
                if v == <unsigned long long>-1 and PyErr_Occurred() != NULL:
                    PyErr_Clear()
                    got = 0
                else:
                    keys[t] = v
                    got = 1
            if not got:  # an int outside u64: never indexed (and hashable)
                m = t
                break
            i = _mix(keys[t]) & smask
            pos[t] = i
            __builtin_prefetch(&slots[i])
        for t in range(m):  # the likely record of each hash (first candidate of its probe)
            j = slots[pos[t]]
            if j >= 0:
                __builtin_prefetch(&self.hm[j])
        for t in range(m):
            i = pos[t]
            h = keys[t]
            while True:
                j = slots[i]
                if j < 0 or self.hm[j].h == h:
                    break
                i = (i + 1) & smask
            if j < 0:
                odd[0] = False
                return t
            out[t] = j
        return m

    cdef int32_t _resolve_odd(self, object o) except -2:
        """Record number of a lookup item that is not an exact int (``-1``: not indexed).
        May run Python code (``__index__``, ``__hash__``); unhashable items raise
        ``TypeError`` like a dict lookup."""
        cdef uint64_t k
        if not _key(o, &k):
            return -1
        return self._find(k)

    def lookup(self, hashes):
        """Longest cached prefix of ``hashes`` at each location.

        One pass over ``hashes`` (sequence hashes of a request's full blocks, first block
        first): the running AND of the blocks' location masks; a location's answer is the
        depth where its bit drops out.  Items are looked up like dict keys (ints; integral
        floats and objects with ``__index__`` equal to an indexed hash find it).

        Returns:
            ``{location: n}``: the first ``n`` blocks are all held at ``location``
            (``n >= 1``; locations holding none of the prefix are absent).

        Raises:
            TypeError: ``hashes`` is not a sequence or iterable, or an item reached is
                unhashable.
            RuntimeError: an item's ``__index__``/``__hash__`` changed the index's locations.
        """
        cdef uint64_t active = M64, m, lost
        cdef Py_ssize_t n = 0, total, base, got, t, want
        cdef int32_t idx[CHUNK]
        cdef int32_t j
        cdef PyObject** items
        cdef dict result = {}
        cdef list names = self._loc_names
        cdef bint odd
        cdef Py_ssize_t nnames = len(names)
        if self._wide:  # some block holds a location bit >= 64 (not just: once had 64+ locations)
            return self._lookup_wide(hashes)
        seq = PySequence_Fast(hashes, "lookup() needs a sequence of sequence hashes")
        base = 0
        cdef bint stop = False
        while not stop:
            total = PySequence_Fast_GET_SIZE(seq)
            if base >= total:
                break
            items = PySequence_Fast_ITEMS(seq)
            want = total - base if total - base < CHUNK else CHUNK
            got = self._resolve(items + base, want, idx, &odd)
            base += got
            stop = got < want and not odd
            while True:
                for t in range(got):
                    m = active & self.hm[idx[t]].mask
                    if m != active:
                        if n:
                            lost = active & ~m
                            while lost:
                                result[names[__builtin_ctzll(lost)]] = n
                                lost &= lost - 1
                        if not m:
                            return result
                        active = m
                    n += 1
                if not odd:
                    break
                # item ``base`` needs Python code, which may change ``seq`` or the index:
                # the records above are folded in first, the storage is fetched again after
                odd = False
                o = <object>items[base]
                j = self._resolve_odd(o)
                if self._loc_names is not names or len(names) != nnames:
                    raise RuntimeError("the index's locations changed during lookup()")
                if j < 0:
                    stop = True
                    break
                idx[0] = j
                got = 1
                base += 1
        if n:
            while active:
                result[names[__builtin_ctzll(active)]] = n
                active &= active - 1
        return result

    def _lookup_wide(self, hashes):
        """:meth:`lookup` with masks as Python ints (a block holds a location bit >= 64).
        Items may run Python code (``__index__``, ``__hash__``), so ``names`` is indexed
        with bounds checks (an untyped object, not the unchecked ``list`` fast path)."""
        cdef uint64_t h
        cdef int32_t j
        cdef object names = self._loc_names
        result = {}
        active = -1
        n = 0
        for o in hashes:
            if not _key(o, &h):
                break
            j = self._find(h)
            if j < 0:
                break
            m = active & self._mask(j)
            if m != active:
                if n:
                    for bit in _bits(active & ~m):
                        result[names[bit]] = n
                if not m:
                    return result
                active = m
            n += 1
        if n:
            for bit in _bits(active):
                result[names[bit]] = n
        return result

    def lookup_any(self, hashes):
        """Number of leading blocks of ``hashes`` held at *some* location (tiers may mix).

        Raises:
            TypeError: ``hashes`` is not a sequence or iterable, or an item reached is
                unhashable.
        """
        cdef Py_ssize_t n = 0, total, got, want
        cdef int32_t idx[CHUNK]
        cdef PyObject** items
        cdef bint odd
        seq = PySequence_Fast(hashes, "lookup_any() needs a sequence of sequence hashes")
        while True:
            total = PySequence_Fast_GET_SIZE(seq)
            if n >= total:
                break
            items = PySequence_Fast_ITEMS(seq)
            want = total - n if total - n < CHUNK else CHUNK
            got = self._resolve(items + n, want, idx, &odd)
            n += got
            if odd:
                o = <object>items[n]
                if self._resolve_odd(o) < 0:
                    break
                n += 1
                continue
            if got < want:
                break
        return n

    def blocks_at(self, location):
        """Sequence hashes held at ``location`` (a copy; a scan of the table for g1/g2)."""
        bit = self._loc_bit.get(location)
        return set(self._held(bit)) if bit is not None else set()

    def count_at(self, location):
        """Number of blocks held at ``location``."""
        bit = self._loc_bit.get(location)
        return self._loc_counts[bit] if bit is not None else 0

    def holds(self, h, location):
        """Whether block ``h`` is held at ``location``."""
        cdef uint64_t k
        cdef int32_t j
        if not _key(h, &k):
            return False
        j = self._find(k)
        bit = self._loc_bit.get(location)
        return j >= 0 and bit is not None and bool(self._has_bit(j, bit))

    def children(self, h):
        """Indexed blocks whose parent is ``h`` (``h`` itself need not be indexed)."""
        cdef uint64_t k
        cdef int32_t j
        if not _key(h, &k):
            return set()
        j = self._find(k)
        if j >= 0:
            return set(self._kids(j))
        return set(self._waiting.get(h, ()))

    def locations(self):
        """Locations that hold at least one block, sorted."""
        return sorted(name for name, n in zip(self._loc_names, self._loc_counts) if n)

    def orphans(self):
        """Indexed blocks whose parent is not indexed (a copy)."""
        return set(self._orphans)

    def sources(self):
        """Per-source epoch / last seq / counts (live objects; do not mutate)."""
        return self._sources

    def hashes(self):
        """Every indexed sequence hash (a list, in table order)."""
        cdef int32_t j
        cdef list out = []
        for j in range(self.nrec):
            if self.recs[j].flags & F_LIVE:
                out.append(self.hm[j].h)
        return out

    def _records(self):
        """``(h, parent, prefix, size, mask, hits, last)`` of every block, in table order."""
        cdef int32_t j
        cdef Rec* r
        out = []
        for j in range(self.nrec):
            r = &self.recs[j]
            if r.flags & F_LIVE:
                out.append((self.hm[j].h, r.parent if r.flags & F_PARENT else None, r.prefix, r.size, self._mask(j),
                            r.hits, r.last))
        return out

    def _put_record(self, h, parent, prefix, size, mask, hits, last):
        """Insert or overwrite a block record (snapshot import; children are linked by
        :meth:`_link_all`).  Raises ``OverflowError``/``TypeError`` for values outside
        u64 (u32 for ``size``) and ``TypeError`` for a field that is not an int (a float
        would otherwise be truncated), or ``ValueError`` for a block that is its own parent."""
        if not (PyLong_CheckExact(h) and PyLong_CheckExact(prefix) and PyLong_CheckExact(size)
                and PyLong_CheckExact(hits) and PyLong_CheckExact(last)
                and (parent is None or PyLong_CheckExact(parent))):
            raise TypeError(f"block {h!r} has a field that is not an int")
        if parent is not None and parent == h:
            raise ValueError(f"block {h!r} is its own parent")
        cdef uint64_t k = h
        cdef uint64_t pf = prefix
        cdef uint32_t sz = size
        cdef uint64_t hi = hits
        cdef uint64_t la = last
        cdef uint64_t pa = 0 if parent is None else parent
        cdef int32_t j = self._find(k)
        if j < 0:
            j = self._insert(k)
        cdef Rec* r = &self.recs[j]
        r.prefix = pf
        r.size = sz
        r.hits = hi
        r.last = la
        r.parent = pa
        if parent is None:
            r.flags &= ~F_PARENT
        else:
            r.flags |= F_PARENT
        self._set_mask(j, mask)

    def _link_all(self):
        """Link every record to its indexed parent, or register it as waiting (import)."""
        cdef int32_t j, pj
        cdef Rec* r
        for j in range(self.nrec):
            r = &self.recs[j]
            if not (r.flags & F_LIVE) or not (r.flags & F_PARENT):
                continue
            pj = self._find(r.parent)
            if pj < 0:
                ws = self._waiting.get(r.parent)
                if ws is None:
                    self._waiting[r.parent] = {self.hm[j].h}
                else:
                    ws.add(self.hm[j].h)
            else:
                self._link(pj, j)

    def _max_probe(self):
        """Longest probe distance in the slot table (slots between a hash's home slot and
        where it sits): a diagnostic of clustering (``O(log n)`` for well-mixed hashes)."""
        cdef uint64_t i, home, m = self.smask, d, worst = 0
        cdef int32_t j
        for i in range(m + 1):
            j = self.slots[i]
            if j >= 0:
                home = _mix(self.hm[j].h) & m
                d = (i - home) & m
                if d > worst:
                    worst = d
        return worst

    def _memory_bytes(self):
        """Bytes of the C arrays (records, slots, event scratch)."""
        return self.rcap * (sizeof(Rec) + sizeof(HM)) + (self.smask + 1) * sizeof(int32_t) + self.evcap * sizeof(Ev)


def _reported_hits(extra):
    if not extra:
        return 0
    n = extra.get(HITS_KEY)
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n if n < U64_MAX else U64_MAX
    return 0
