# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled encoder of Store / Remove events straight from block identities.

A block pool hands the publisher the events of one batch call (the Stores of the blocks it
registered, the Removes of the blocks it evicted) as MessagePack bytes built here from the
blocks' identities, without one ``KVEvent`` object per event.  The bytes are exactly those
``msgspec.msgpack.Encoder().encode`` writes for the equivalent ``KVEvent`` objects
(``event_plane.codec.encode_event``), concatenated: KVEvent v1 positional arrays
(``docs/events.md`` §2)::

    [type, sequence_hash: u64, prefix_hash: u64, parent_hash: u64 | nil,
     block_size: u32, storage_location: str, extra_metadata: nil]

Integers use MessagePack's smallest form (positive fixint, uint8, uint16, uint32, uint64),
as msgspec does; the constant tail (``block_size``, ``storage_location``, ``nil``) is
encoded once per pool by msgspec itself (:func:`event_tail`).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_CheckExact
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject, PyTypeObject
from libc.string cimport memcpy

import sys

import msgspec


cdef extern from *:
    """
    #include <structmember.h>
    /* Offset of the __slots__ member ``name`` in instances of ``tp``, or -1 when ``name``
       is not such a member for ``tp``: found as attribute lookup finds it (the first
       class of tp's MRO defining it: a property or anything else there means -1), an
       object member (T_OBJECT_EX: NULL when unset), and one of a class ``tp`` derives
       from (so its offset lies inside tp's instances; a member descriptor copied from
       another class onto ``tp`` would make getattr raise TypeError: -1).  Runs no Python
       code: _PyType_Lookup only compares str keys of the classes' dicts. */
    static Py_ssize_t kvfast_slot_offset(PyObject *tp, PyObject *name) {
        PyObject *d = _PyType_Lookup((PyTypeObject *)tp, name);  /* borrowed, sets no error */
        PyMemberDescrObject *md;
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
        md = (PyMemberDescrObject *)d;
        if (md->d_member->type != T_OBJECT_EX) return -1;
        if (!PyType_IsSubtype((PyTypeObject *)tp, PyDescr_TYPE(md))) return -1;
        return md->d_member->offset;
    }
    /* Whether instances of ``tp`` use object's own attribute lookup (no __getattribute__
       or __getattr__ of their own). */
    static int kvfast_generic_getattr(PyObject *tp) {
        return ((PyTypeObject *)tp)->tp_getattro == PyObject_GenericGetAttr;
    }
    /* tp's attribute-cache version tag, 0 when it has none: CPython clears it whenever
       tp or one of its bases is changed (an attribute set or deleted on the class). */
    static unsigned int kvfast_version(PyObject *tp) {
        PyTypeObject *t = (PyTypeObject *)tp;
        return PyType_HasFeature(t, Py_TPFLAGS_VALID_VERSION_TAG) ? t->tp_version_tag : 0;
    }
    """
    Py_ssize_t kvfast_slot_offset(object tp, object name)
    bint kvfast_generic_getattr(object tp)
    unsigned int kvfast_version(object tp)

# Fast attribute reads: for the last class of identities seen whose three fields are plain
# __slots__ members (kvbm_runtime.BlockMeta) and whose attribute lookup is object's, the
# fields are read straight from their slots (what getattr would return); any other class
# goes through getattr.  The class's version tag is remembered with its offsets: a class
# changed since (CPython then clears its tag) is looked at again.  Set under the GIL.
cdef object _slot_type = None
cdef unsigned int _slot_version = 0
cdef Py_ssize_t _off_seq = 0, _off_prefix = 0, _off_parent = 0
_FIELDS = ("sequence_hash", "prefix_hash", "parent_hash")
cdef object _N_SEQ = sys.intern("sequence_hash")
cdef object _N_PREFIX = sys.intern("prefix_hash")
cdef object _N_PARENT = sys.intern("parent_hash")


cdef bint _learn(object tp):
    """Remember ``tp``'s slot offsets when its fields can be read from slots (as getattr
    would read them).  Runs no Python code, so the list being encoded cannot change here."""
    global _slot_type, _slot_version, _off_seq, _off_prefix, _off_parent
    if not kvfast_generic_getattr(tp):
        return False
    cdef Py_ssize_t a = kvfast_slot_offset(tp, _N_SEQ)
    cdef Py_ssize_t b = kvfast_slot_offset(tp, _N_PREFIX)
    cdef Py_ssize_t c = kvfast_slot_offset(tp, _N_PARENT)
    cdef unsigned int version = kvfast_version(tp)  # assigned by the lookups above
    if a < 0 or b < 0 or c < 0 or version == 0:
        return False
    _off_seq, _off_prefix, _off_parent = a, b, c
    _slot_version = version
    _slot_type = tp
    return True


cdef inline bint _fast(object tp):
    """Whether instances of ``tp`` may be read from their slots (learning ``tp`` if new or
    changed)."""
    return (tp is _slot_type and kvfast_version(tp) == _slot_version) or _learn(tp)


cdef inline PyObject* _slot(object obj, Py_ssize_t offset) noexcept:
    return (<PyObject**>((<char*><PyObject*>obj) + offset))[0]


cdef inline bint _hash_slots(object meta, PyObject** ps, PyObject** pp, PyObject** pq):
    """Point ``ps`` / ``pp`` / ``pq`` at ``meta``'s sequence, prefix and parent hash slots
    (borrowed) and return True when ``meta`` is of the learned slotted class and all three
    are set; False otherwise (the caller then reads the attributes with ``getattr``)."""
    if not _fast(type(meta)):
        return False
    ps[0] = _slot(meta, _off_seq)
    pp[0] = _slot(meta, _off_prefix)
    pq[0] = _slot(meta, _off_parent)
    return ps[0] != NULL and pp[0] != NULL and pq[0] != NULL

_encoder = msgspec.msgpack.Encoder()

# fixarray of 7 + type (positive fixint) + 3 hashes of at most 9 bytes each
cdef enum:
    _HEAD_MAX = 1 + 1 + 3 * 9


cdef inline unsigned char* _put_uint(unsigned char* p, unsigned long long v) noexcept:
    """Write ``v`` in MessagePack's smallest unsigned form; returns the end."""
    if v < 0x80:
        p[0] = <unsigned char>v
        return p + 1
    if v <= 0xFF:
        p[0] = 0xCC
        p[1] = <unsigned char>v
        return p + 2
    if v <= 0xFFFF:
        p[0] = 0xCD
        p[1] = <unsigned char>(v >> 8)
        p[2] = <unsigned char>v
        return p + 3
    if v <= 0xFFFFFFFF:
        p[0] = 0xCE
        p[1] = <unsigned char>(v >> 24)
        p[2] = <unsigned char>(v >> 16)
        p[3] = <unsigned char>(v >> 8)
        p[4] = <unsigned char>v
        return p + 5
    p[0] = 0xCF
    p[1] = <unsigned char>(v >> 56)
    p[2] = <unsigned char>(v >> 48)
    p[3] = <unsigned char>(v >> 40)
    p[4] = <unsigned char>(v >> 32)
    p[5] = <unsigned char>(v >> 24)
    p[6] = <unsigned char>(v >> 16)
    p[7] = <unsigned char>(v >> 8)
    p[8] = <unsigned char>v
    return p + 9


cdef extern from *:
    """
    /* An exact int as a u64: on CPython 3.11 (30-bit digits, the only layout this project
       builds for) read its digits directly; else, or when it does not fit (negative or
       >= 2**64: OverflowError), PyLong_AsUnsignedLongLong, which goes through
       _PyLong_AsByteArray and is several times slower for hashes >= 2**30. */
    static int kvfast_u64(PyObject *o, unsigned long long *out) {
    #if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
        const Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        switch (size) {
        case 0: *out = 0; return 0;
        case 1: *out = (unsigned long long)d[0]; return 0;
        case 2: *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30); return 0;
        case 3:
            if (d[2] < 16) {
                *out = (unsigned long long)d[0] | ((unsigned long long)d[1] << 30) | ((unsigned long long)d[2] << 60);
                return 0;
            }
            break;
        default: break;
        }
    #endif
        {
            unsigned long long v = PyLong_AsUnsignedLongLong(o);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
            *out = v;
            return 0;
        }
    }
    """
    int kvfast_u64(object o, unsigned long long* out) except -1


cdef inline unsigned long long _u64(object value, str name) except? 0xFFFFFFFFFFFFFFFF:
    """An exact ``int`` in [0, 2**64) as a C integer (``bool`` and other types refused:
    msgspec would encode them differently); OverflowError when negative or >= 2**64."""
    cdef unsigned long long v
    if not PyLong_CheckExact(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    kvfast_u64(value, &v)
    return v


def event_tail(block_size, storage_location):
    """The constant last three fields of a pool's events, MessagePack-encoded by msgspec:
    ``block_size`` (u32), ``storage_location`` (str of 1..255 characters) and a nil
    ``extra_metadata``.

    Raises:
        ValueError: ``block_size`` is not an int in [0, 2**32) or ``storage_location``
            not a str of 1..255 characters (no valid event could carry them).
    """
    if type(block_size) is not int or not 0 <= block_size <= 0xFFFFFFFF:
        raise ValueError(f"block_size must be an int in [0, 2**32), got {block_size!r}")
    if type(storage_location) is not str or not 1 <= len(storage_location) <= 255:
        raise ValueError(f"storage_location must be a str of 1..255 characters, got {storage_location!r}")
    return _encoder.encode((block_size, storage_location, None))[1:]  # drop the fixarray(3) header


def encode_meta_events(int event_type, list metas not None, bytes tail not None):
    """Encode one event of type ``event_type`` per block identity in ``metas``.

    Args:
        event_type: 0 (Store) or 1 (Remove) (``EventType``).
        metas: objects with ``sequence_hash``, ``prefix_hash`` (ints in [0, 2**64)) and
            ``parent_hash`` (such an int or ``None``) attributes, e.g.
            ``kvbm_runtime.BlockMeta``; one event each, in order.
        tail: :func:`event_tail` of the events' block size and storage location.

    Returns:
        The events' MessagePack bytes, concatenated (no array header): byte-identical to
        ``b"".join(encode_event(KVEvent(event_type, m.sequence_hash, m.prefix_hash,
        m.parent_hash, block_size, storage_location)) for m in metas)``.

    Raises:
        ValueError: ``event_type`` is not 0 or 1.
        TypeError: a hash is not an ``int`` (``bool`` included).
        OverflowError: a hash is negative or >= 2**64.
        AttributeError: an item of ``metas`` lacks one of the three attributes.
        TypeError: ``metas`` is not a list or ``tail`` not bytes (``None`` included).
        RuntimeError: reading an item's attributes (Python code: a property) changed the
            length of ``metas``.
    """
    if event_type != 0 and event_type != 1:
        raise ValueError(f"event_type must be 0 (Store) or 1 (Remove), got {event_type}")
    cdef Py_ssize_t n = PyList_GET_SIZE(metas)
    cdef Py_ssize_t tail_len = PyBytes_GET_SIZE(tail)
    cdef Py_ssize_t i
    cdef object out = PyBytes_FromStringAndSize(NULL, n * (_HEAD_MAX + tail_len))
    cdef unsigned char* start = <unsigned char*>PyBytes_AS_STRING(out)
    cdef unsigned char* p = start
    cdef const unsigned char* t = <const unsigned char*>PyBytes_AS_STRING(tail)
    cdef unsigned char kind = <unsigned char>event_type
    cdef object meta, parent, seq_obj, prefix_obj
    cdef PyObject* ps
    cdef PyObject* pp
    cdef PyObject* pq
    cdef unsigned long long s, pre, par
    for i in range(n):
        if PyList_GET_SIZE(metas) != n:  # changed by Python code of an item (getattr, event_cls)
            raise RuntimeError(f"metas changed size during encoding ({n} -> {PyList_GET_SIZE(metas)})")
        meta = <object>PyList_GET_ITEM(metas, i)
        if _hash_slots(meta, &ps, &pp, &pq):
            seq_obj, prefix_obj, parent = <object>ps, <object>pp, <object>pq
        else:  # any other class, or a slot left unset (getattr raises AttributeError)
            seq_obj, prefix_obj, parent = meta.sequence_hash, meta.prefix_hash, meta.parent_hash
        s = _u64(seq_obj, "sequence_hash")
        pre = _u64(prefix_obj, "prefix_hash")
        p[0] = 0x97
        p[1] = kind
        p = _put_uint(p + 2, s)
        p = _put_uint(p, pre)
        if parent is None:
            p[0] = 0xC0
            p += 1
        else:
            par = _u64(parent, "parent_hash")
            p = _put_uint(p, par)
        memcpy(p, t, tail_len)
        p += tail_len
    return out[: p - start]


def make_meta_events(event_cls, event_type, list metas not None, block_size, storage_location):
    """``[event_cls(event_type, m.sequence_hash, m.prefix_hash, m.parent_hash, block_size,
    storage_location) for m in metas]`` without the interpreter loop: the KVEvent objects
    a pool hands a sink that takes objects (not a publisher).

    Args:
        event_cls: the event class (``event_plane.KVEvent``).
        event_type: its ``type`` (``EventType.STORE`` / ``EventType.REMOVE``).
        metas: block identities, as for :func:`encode_meta_events`.
        block_size, storage_location: the events' other fields.

    Returns:
        A new list of events, in the order of ``metas``.

    Raises:
        AttributeError: an item of ``metas`` lacks one of the three attributes.
        TypeError: ``metas`` is not a list (``None`` included).
        RuntimeError: Python code run for an item (a property, ``event_cls``) changed the
            length of ``metas``.
    """
    cdef Py_ssize_t n = PyList_GET_SIZE(metas)
    cdef Py_ssize_t i
    cdef list out = [None] * n
    cdef object meta
    cdef PyObject* ps
    cdef PyObject* pp
    cdef PyObject* pq
    for i in range(n):
        if PyList_GET_SIZE(metas) != n:  # changed by Python code of an item (getattr, event_cls)
            raise RuntimeError(f"metas changed size during encoding ({n} -> {PyList_GET_SIZE(metas)})")
        meta = <object>PyList_GET_ITEM(metas, i)
        if _hash_slots(meta, &ps, &pp, &pq):
            out[i] = event_cls(event_type, <object>ps, <object>pp, <object>pq, block_size, storage_location)
        else:
            out[i] = event_cls(
                event_type, meta.sequence_hash, meta.prefix_hash, meta.parent_hash, block_size, storage_location
            )
    return out
