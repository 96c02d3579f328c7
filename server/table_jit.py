"""The compiled loops of the dynamic tables' hash index (numba, cached on disk): use them through
server/table_kernels.py, which types them and imports this module (and numba) on first use only.

Why compiled: a batch probe in numpy is a dozen passes over the batch and as many temporaries (about
100 ns a key at a million keys); one loop reads a key's bucket, its tags and one key, and stops (about
20-40 ns, most of it the cache misses of the slot and the key). Inserts place keys one by one, in
order, so the "keys of one batch want the same free slot" rounds are gone.

Slot values are `tag | row + 1` (0 empty, -1 deleted) as server/hash_index.py describes; the hash is
splitmix64's finalizer of the key, the value pscluster.tables.mix64 returns (a unit test holds them equal).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_INC = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S33 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(33)
_EMPTY = np.int32(0)
_TOMB = np.int32(-1)


def _prefetch(typingctx, arr, idx):
    """Start loading the cache line of arr[idx] (a 1-D array, an int index) and go on: LLVM's prefetch (a
    read, kept in every cache level). numba has no prefetch of its own, and a plain read to warm a line
    holds the CPU's reorder window until the line comes, which allows only a few misses in flight; a
    prefetch retires at once."""

    def codegen(context, builder, signature, args):
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        at = context.cast(builder, args[1], idxty, types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [at])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, idx), codegen


prefetch: Any = intrinsic(_prefetch)  # Any: mypy would check calls against numba's typing signature


@njit(cache=True, nogil=True)
def mix(key):
    """mix64 of one int64 key (uint64)."""
    z = np.uint64(key) + _INC
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _tag(h, row_bits, tag_mask):
    return np.int32(((h >> _S33) & tag_mask) << np.uint64(row_bits))


@njit(cache=True, nogil=True)
def _home(h, size):
    return np.int64(h & np.uint64((size >> 3) - 1)) << 3  # the first slot of the key's 8-slot bucket


@njit(cache=True, nogil=True)
def _probe(slots, row_keys, key, h, tag, row_mask):
    """Slot position of key in slots, -1 if absent: linear probing from its bucket's first slot to the
    first empty slot (tombstones and other keys' slots are passed)."""
    size = slots.size
    mask = size - 1
    p = _home(h, size)
    for _ in range(size):
        s = slots[p]
        if s == _EMPTY:
            return -1
        if s > 0 and (s & ~row_mask) == tag and row_keys[(s & row_mask) - 1] == key:
            return p
        p = (p + 1) & mask
    return -1


GROUP = 32  # keys whose memory reads one lookup round overlaps
AHEAD = 8  # rows ahead whose cache lines a row update prefetches


@njit(cache=True, nogil=True)
def lookup(slots, old, row_keys, keys, row_bits, tag_mask, out):
    """out[i] = row id of keys[i] (-1 absent), searched in slots, then in old (size 0: none); returns how
    many keys are absent.

    Keys go in groups of GROUP through three stages, software-pipelined so that no stage waits for memory
    it asked for just before: hash a group's keys and prefetch their buckets; for the group before, pick
    the first slot of each bucket with the key's tag and prefetch that row's key; then check each key. A
    key whose bucket has no slot with its tag, or whose tag matched another key, is probed in full.
    Plain reads in a loop that branches on each slot wait for each miss in turn (110-190 ns a key at
    1 M keys here, even grouped); prefetches retire at once, so a group's misses overlap (45-60 ns).
    The row copy stays out of this loop: numba's copy of a row ran 1.4-1.9 x np.take's here.
    """
    row_mask = np.int32((1 << row_bits) - 1)
    tmask = np.uint64(tag_mask)
    size = slots.size
    absent = 0
    n = keys.size
    hs = np.empty((2, GROUP), np.uint64)
    cand = np.empty(GROUP, np.int64)
    for j in range(min(GROUP, n)):
        h = mix(keys[j])
        hs[0, j] = h
        prefetch(slots, _home(h, size))
    for gi, g in enumerate(range(0, n, GROUP)):
        cur = gi & 1
        m = min(GROUP, n - g)
        for j in range(m):
            h = hs[cur, j]
            tag = _tag(h, row_bits, tmask)
            p = _home(h, size)
            c = -1
            for q in range(8):
                s = slots[p + q]
                if s == _EMPTY:
                    break
                if s > 0 and (s & ~row_mask) == tag:
                    c = (s & row_mask) - 1
                    break
            cand[j] = c
            if c >= 0:
                prefetch(row_keys, c)
        for j in range(min(GROUP, n - g - GROUP)):  # the next group's first stage
            h = mix(keys[g + GROUP + j])
            hs[1 - cur, j] = h
            prefetch(slots, _home(h, size))
        for j in range(m):
            key = keys[g + j]
            c = cand[j]
            if c < 0 or row_keys[c] != key:
                h = hs[cur, j]
                tag = _tag(h, row_bits, tmask)
                c = -1
                p = _probe(slots, row_keys, key, h, tag, row_mask)
                if p >= 0:
                    c = (slots[p] & row_mask) - 1
                elif old.size:
                    p = _probe(old, row_keys, key, h, tag, row_mask)
                    if p >= 0:
                        c = (old[p] & row_mask) - 1
            out[g + j] = c
            if c < 0:
                absent += 1
    return absent


@njit(cache=True, nogil=True)
def erase(slots, row_keys, keys, row_bits, tag_mask):
    """Replace the slot of each key found in slots by a tombstone; returns how many were found."""
    row_mask = np.int32((1 << row_bits) - 1)
    tmask = np.uint64(tag_mask)
    found = 0
    for i in range(keys.size):
        key = keys[i]
        h = mix(key)
        p = _probe(slots, row_keys, key, h, _tag(h, row_bits, tmask), row_mask)
        if p >= 0:
            slots[p] = _TOMB
            found += 1
    return found


@njit(cache=True, nogil=True)
def _put(slots, h, value):
    """value into the first free (empty or deleted) slot of h's chain; 1 if it was a tombstone."""
    mask = slots.size - 1
    p = _home(h, slots.size)
    for _ in range(slots.size):  # the table is at most half full: a free slot comes
        if slots[p] <= 0:
            reused = 1 if slots[p] == _TOMB else 0
            slots[p] = value
            return reused
        p = (p + 1) & mask
    # a broken invariant must fail the call, not spin without the GIL under the shard's lock
    raise RuntimeError("hash index has no free slot: the index keeps at most half of its slots in use")


@njit(cache=True, nogil=True)
def place(slots, keys, rows, row_bits, tag_mask):
    """Give each key (absent) the slot value of its row rows[i]; returns (tombstones reused, a value to
    ignore). A group's home slots are prefetched first, so their cache misses overlap (as in lookup):
    2 M keys into an index in batches of 65,536 took 172-206 ns a key of CPU with plain reads there,
    100-130 with prefetches (load 9)."""
    tmask = np.uint64(tag_mask)
    size = slots.size
    hs = np.empty(GROUP, np.uint64)
    reused = 0
    for g in range(0, keys.size, GROUP):
        m = min(GROUP, keys.size - g)
        for j in range(m):
            h = mix(keys[g + j])
            hs[j] = h
            prefetch(slots, _home(h, size))
        for j in range(m):
            h = hs[j]
            reused += _put(slots, h, _tag(h, row_bits, tmask) | np.int32(rows[g + j] + 1))
    return reused, 0  # (the second value is kept for the callers' unpacking)


@njit(cache=True, nogil=True)
def move(old, start, end, slots, row_keys, row_bits):
    """Move the live entries of old[start:end] into slots (their values unchanged: the tag and the row do
    not depend on the table's size), leaving tombstones behind, which keep the chains of the keys
    still to move intact; returns (tombstones of slots reused, a value to ignore). Entries go in groups, as in place."""
    row_mask = np.int32((1 << row_bits) - 1)
    size = slots.size
    hs = np.empty(GROUP, np.uint64)
    vs = np.empty(GROUP, np.int32)
    reused = 0
    p = start
    while p < end:
        m = 0
        while p < end and m < GROUP:
            s = old[p]
            if s > 0:
                vs[m] = s
                hs[m] = mix(row_keys[(s & row_mask) - 1])
                prefetch(slots, _home(hs[m], size))
                old[p] = _TOMB
                m += 1
            p += 1
        for j in range(m):
            reused += _put(slots, hs[j], vs[j])
    return reused, 0  # (the second value is kept for the callers' unpacking)


@njit(cache=True, nogil=True)
def group_by_shard(keys, num_shards, order, starts):
    """Positions of keys grouped by shard (pscluster.tables.shard_of), in order within a shard, into
    order; shard i's are order[starts[i]:starts[i + 1]]. Two passes, no temporaries of the keys' size
    but one shard number a key."""
    n = np.uint64(num_shards)
    shard = np.empty(keys.size, np.int32)
    counts = np.zeros(num_shards + 1, np.int64)
    for i in range(keys.size):
        s = np.int32(((mix(keys[i]) >> np.uint64(32)) * n) >> np.uint64(32))
        shard[i] = s
        counts[s + 1] += 1
    for i in range(num_shards):
        counts[i + 1] += counts[i]
    starts[:] = counts
    for i in range(keys.size):
        s = shard[i]
        order[counts[s]] = i
        counts[s] += 1


@njit(cache=True, nogil=True)
def repeated(keys, out):
    """out[i] = whether keys[i] occurs more than once in keys; returns how many such positions. One pass
    through a hash set of twice the keys' size (positions + 1, 0 empty)."""
    size = 1
    while size < 2 * keys.size:
        size *= 2
    mask = size - 1
    seen = np.zeros(size, np.int64)
    count = 0
    for i in range(keys.size):
        key = keys[i]
        p = np.int64(mix(key) & np.uint64(mask))
        while True:
            j = seen[p] - 1
            if j < 0:
                seen[p] = i + 1
                out[i] = False
                break
            if keys[j] == key:
                if not out[j]:
                    out[j] = True
                    count += 1
                out[i] = True
                count += 1
                break
            p = (p + 1) & mask
    return count


@njit(cache=True, nogil=True)
def sum_repeated(keys, grads, in_dup):
    """(keys, counts, gradients): the keys not marked in in_dup in their order with their rows, then the
    marked ones once each, ascending, each with its rows summed in float64 in arrival order (then cast)."""
    n, dim = grads.shape
    dup_at = np.flatnonzero(in_dup)
    order = dup_at[np.argsort(keys[dup_at], kind="mergesort")]  # stable: arrival order within a key
    groups = 0
    for j in range(order.size):
        if j == 0 or keys[order[j]] != keys[order[j - 1]]:
            groups += 1
    singles = n - dup_at.size
    out_keys = np.empty(singles + groups, np.int64)
    out_counts = np.ones(singles + groups, np.int64)
    out_grads = np.empty((singles + groups, dim), grads.dtype)
    k = 0
    for i in range(n):
        if not in_dup[i]:
            out_keys[k] = keys[i]
            out_grads[k, :] = grads[i, :]
            k += 1
    acc = np.zeros(dim, np.float64)
    j = 0
    while j < order.size:
        key = keys[order[j]]
        acc[:] = 0.0
        count = 0
        while j < order.size and keys[order[j]] == key:
            for d in range(dim):
                acc[d] += np.float64(grads[order[j], d])
            count += 1
            j += 1
        out_keys[k] = key
        out_counts[k] = count
        for d in range(dim):
            out_grads[k, d] = acc[d]
        k += 1
    return out_keys, out_counts, out_grads
