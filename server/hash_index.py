"""A vectorized open-addressing hash index: int64 key -> row id, with the row ids it hands out.

Why not a dict: a Python dict costs about 98 bytes per int key and one interpreter step per key; this
index costs 4 bytes per slot (8 to 20 per key at its load of 1/5 to 1/2) plus the key itself, and
probes whole batches in numpy.

The slot table holds `tag | row + 1` (0 = empty, -1 = deleted), never a key, so every int64 key is
valid (0, -1 and 2**63-1 included): there is no key sentinel to collide with. A slot's key is read from
`row_keys[row]`; the tag (bits of the key's hash above the row id's bits, as many as fit in 31) lets a
lookup pick the one slot worth reading a key for. Linear probing from the first slot of the key's
bucket of BUCKET slots (32 bytes, `mix64(key)`'s low bits pick it): a lookup reads that whole bucket
with one row gather, compares tags, and checks one key, which settles about 97 % of the keys of a batch
at a load of 1/2; the others go through the probing rounds below. Deletion leaves a tombstone, and the table is
replaced (by one of 2.5 x its live keys, rounded up to a power of two) when live entries plus tombstones
pass half of it. The move is incremental, so growing never stops the shard for a whole rehash: the old
table stays searchable while each insert moves a bounded stretch of it (MOVE_PER_KEY old slots per new
key, at least MOVE_MIN), which finishes the move before the new table can fill. The next table's
pages are written (committed) a stretch per insert while the load climbs from 7/16 to 1/2, so the
batch that starts a move does not take a page fault for each of its keys (138 ms of a batch of 65,536
at 8 M keys here).

Row ids are dense in [0, capacity): a freed row is reused by a later insert, so arrays indexed by row
(values, slots, metadata) never grow past the capacity and hold one key's state per row id.

    index = HashIndex(capacity=1 << 20)
    rows = index.insert(np.array([7, -1], np.int64))   # keys known to be absent
    index.lookup(np.array([-1, 5], np.int64))          # -> [rows[1], -1]
"""

from __future__ import annotations

import numpy as np

from pscluster.errors import InvalidArgumentError, ResourceExhaustedError
from pscluster.tables import mix64 as mix64
from pscluster.tables import shard_of as shard_of

_EMPTY = 0
_TOMB = -1
MIN_SLOTS = 1024
# old slots moved per inserted key: while growing, a move of S old slots has S/2 inserts before the next
# one starts (16: gone after S/16, so a table is rarely left mid-move; 8 halved the longest batch but left
# a table grown to 10 M keys mid-move, searching two slot tables); churn with tombstones can start a move
# sooner, which finishes the last one first. Reads and updates of existing keys move as many per key too
# (advance), so a table that stops growing mid-move does not look keys up in two tables for good.
MOVE_PER_KEY = 16
MOVE_MIN = 1 << 16
TAIL = 64  # keys left in a batch's probing below which each round reads WINDOW slots per key
WINDOW = 32
_STEPS = np.arange(WINDOW, dtype=np.intp)
_BUCKET_BITS = 3
BUCKET = 1 << _BUCKET_BITS  # slots a lookup reads at once (one gather of 32-byte rows); homes are bucket-aligned
_U8 = np.dtype("<u8")  # a bucket's BUCKET one-byte flags as one integer: byte i is slot i on any platform


def _first(flags: np.ndarray) -> np.ndarray:
    """Slot of the lowest set byte of each bucket's flags (a popcount below its lowest set bit); BUCKET
    for none."""
    low = np.bitwise_count((flags & (np.uint64(0) - flags)) - np.uint64(1))
    return np.asarray(low >> np.uint8(3))  # 8 bits a byte


def _spread(pos: np.ndarray) -> np.ndarray:
    """pos with the k-th key (in batch order) of a run of equal positions moved k slots on: keys of one
    batch that want the same first free slot would take a probing round each (a move places millions
    of keys, several a bucket); spread over the slots after it, most are placed in the first round. Any
    slot a key skips is another key's target in the same round, so none stays empty before it."""
    n = pos.size
    idx_bits = max(1, (n - 1).bit_length())
    packed = pos.view(np.uint64) << np.uint64(idx_bits)
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & np.uint64((1 << idx_bits) - 1)).view(np.int64)
    at = (packed >> np.uint64(idx_bits)).view(np.int64)
    starts = np.ones(n, np.bool_)
    np.not_equal(at[1:], at[:-1], out=starts[1:])
    step = np.arange(n, dtype=np.int64)
    first = np.maximum.accumulate(np.where(starts, step, 0))  # where each key's run starts, sorted
    at += step
    at -= first  # + its rank in the run
    out = np.empty(n, np.int64)
    out[order] = at
    return out


def home_slot(h: np.ndarray, size: int) -> np.ndarray:
    """First slot (int64) of the bucket of keys whose mix64 is `h`, in a slot table of `size` slots."""
    return ((h & np.uint64(size // BUCKET - 1)) << np.uint64(_BUCKET_BITS)).view(np.int64)


class HashIndex:
    """int64 key -> dense row id in [0, capacity); rows are reused after removal."""

    def __init__(self, capacity: int, slots: int = MIN_SLOTS, move_min: int = MOVE_MIN,
                 tag_bits: int | None = None) -> None:
        if not 0 < capacity < 2**31 - 1:
            raise InvalidArgumentError(f"capacity must be in [1, 2**31 - 1), got {capacity}")
        self.capacity = capacity
        self._row_bits = capacity.bit_length()  # row + 1 <= capacity fits in them
        self._row_mask = (1 << self._row_bits) - 1
        # fewer tag bits (tests) make false tag matches common; 0 makes every occupied slot a candidate
        self.tag_bits = 31 - self._row_bits if tag_bits is None else min(tag_bits, 31 - self._row_bits)
        # np.zeros at capacity: the OS commits pages on first touch, so rows never move or get copied
        # two spare entries: the first probe reads row_keys[-1] / [-2] for an empty / deleted slot
        self.row_keys = np.zeros(capacity + 2, np.int64)
        self.row_live = np.zeros(capacity, np.bool_)
        self._free = np.zeros(capacity, np.int32)  # a stack of freed row ids
        self._nfree = 0
        self._next_row = 0
        self.live = 0
        self._tombs = 0
        self._slots = np.zeros(_pow2(slots), np.int32)
        self._old: np.ndarray | None = None  # the slot table being moved out of, searched after _slots
        self._cursor = 0  # old slots below it are moved (tombstones now)
        self._spare: np.ndarray | None = None  # the next slot table, its pages committed below _spare_done
        self._spare_done = 0
        self.move_min = move_min
        self.rebuilds = 0

    # -- reads -----------------------------------------------------------------------------------
    @property
    def high_water(self) -> int:
        """Rows ever handed out: every live row id is below it."""
        return self._next_row

    @property
    def nbytes(self) -> int:
        """Bytes this index holds for its live rows' range (slots, keys, live flags, free stack)."""
        old = 0 if self._old is None else self._old.nbytes
        spare = 0 if self._spare is None else self._spare_done * 4  # committed pages only
        return self._slots.nbytes + old + spare + self._next_row * (8 + 1 + 4)

    def _find(self, keys: np.ndarray, slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(slot position of each key in `slots` (default: the current table), its row id), -1 where absent.

        Rounds probe one slot per key while many keys are left: random reads of the slot and key arrays
        are what those rounds cost (cache misses at a million keys), and wider windows read more of
        them. The few keys left after that (at most TAIL) probe WINDOW slots a round, so a batch takes a
        handful of numpy rounds instead of one per slot of its longest chain (37 at 1 M keys here).
        """
        slots = self._slots if slots is None else slots
        row_keys, rm = self.row_keys, self._row_mask
        mask = slots.size - 1
        pos = home_slot(mix64(keys), slots.size)
        # the first probe, for every key at once and without index arrays: most keys end here
        s = slots[pos]
        # an empty / deleted slot reads some key (clipped index), ignored
        hit = (row_keys.take((s & rm) - 1, mode="clip") == keys) & (s > 0)
        out = np.where(hit, pos, -1)
        rows = np.where(hit, s & rm, 0).astype(np.int64) - 1
        active = np.flatnonzero(~hit & (s != _EMPTY))
        pos, want = (pos[active] + 1) & mask, keys[active]
        while active.size > TAIL:
            s = slots[pos]
            occupied = s > 0
            hit = occupied.copy()
            hit[occupied] = row_keys[(s[occupied] & rm) - 1] == want[occupied]
            out[active[hit]] = pos[hit]
            rows[active[hit]] = (s[hit] & rm).astype(np.int64) - 1
            go_on = ~hit & (s != _EMPTY)
            active, pos, want = active[go_on], (pos[go_on] + 1) & mask, want[go_on]
        self._windows(slots, active, pos, want, rows, out)
        return out, rows

    def _windows(self, slots: np.ndarray, active: np.ndarray, pos: np.ndarray, want: np.ndarray,
                 rows: np.ndarray, out: np.ndarray | None = None) -> None:
        """Probe the chains of keys `want` from slots `pos` on, WINDOW slots a round; write the row (and
        with `out`, the slot) of each one found at its place `active` in rows (out)."""
        row_keys, rm, mask = self.row_keys, self._row_mask, slots.size - 1
        while active.size:
            win = (pos[:, None] + _STEPS) & mask
            sw = slots[win]
            match = (row_keys.take((sw & rm) - 1, mode="clip") == want[:, None]) & (sw > 0)
            found = match.any(axis=1)
            j = match.argmax(axis=1)[found]
            if out is not None:
                out[active[found]] = win[found, j]
            rows[active[found]] = (sw[found, j] & rm).astype(np.int64) - 1
            # no empty slot in the window: the chain goes on (deletion leaves tombstones, never holes)
            go_on = ~found & (sw != _EMPTY).all(axis=1)
            active, pos, want = active[go_on], (pos[go_on] + WINDOW) & mask, want[go_on]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row id of each key (int64), -1 where the key is absent."""
        rows = self._rows(keys, self._slots)
        if self._old is not None:  # keys not moved yet are only in the old table
            rest = np.flatnonzero(rows < 0)
            if rest.size:
                rows[rest] = self._rows(keys[rest], self._old)
        return rows

    def _rows(self, keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """_find's row ids, the home bucket read whole: one gather of BUCKET slots per key, their tags
        compared at once, the first match's key checked. A key is settled there when that key is its
        own, or when no slot of the bucket has its tag and one is empty (its chain ends there: absent).
        The others (a false tag match, 1 in 2**tag_bits per slot; a chain past the bucket: about 1 % of
        the keys at a load of 1/2) probe WINDOW slots a round from their home, as _find's last keys do:
        one more round for nearly all of them, where a round of buckets per key would take several."""
        h = mix64(keys)
        nb = slots.size // BUCKET
        b = (h & np.uint64(nb - 1)).view(np.int64)
        buckets = slots.reshape(nb, BUCKET).take(b, axis=0)
        x = buckets ^ self._tags(h)[:, None]  # 1 .. row mask where the tag matches an occupied slot
        x -= 1
        flags = (x.view(np.uint32) < np.uint32(self._row_mask)).view(_U8).reshape(keys.size)
        at = np.arange(0, keys.size * BUCKET, BUCKET, dtype=np.int64)
        at += _first(flags)
        cand = x.reshape(-1).take(at, mode="clip")
        ok = self.row_keys.take(cand, mode="clip") == keys
        ok &= flags != 0
        rows = np.where(ok, cand, -1).astype(np.int64)
        miss = np.flatnonzero(~ok)
        if miss.size:
            empty = (buckets[miss] == _EMPTY).view(_U8).reshape(miss.size) != 0
            rest = miss[(flags[miss] != 0) | ~empty]
            if rest.size:
                self._windows(slots, rest, b[rest] * BUCKET, keys[rest], rows)
        return rows

    def _tags(self, h: np.ndarray) -> np.ndarray:
        """The tag bits of slots for keys whose mix64 is `h` (int32, above the row bits): bits 33 and up
        of the hash, apart from the bucket's bits and from shard_of's top bits (one shard shares those)."""
        t = ((h >> np.uint64(33)) & np.uint64((1 << self.tag_bits) - 1)).astype(np.int32)
        t <<= np.int32(self._row_bits)
        return t

    def live_rows(self) -> np.ndarray:
        """Row ids of every live key, ascending."""
        return np.flatnonzero(self.row_live[:self._next_row])

    # -- writes ----------------------------------------------------------------------------------
    def insert(self, keys: np.ndarray) -> np.ndarray:
        """Give each key (unique, absent: the caller checked) a row id; returns them (int64).

        Raises:
            ResourceExhaustedError: more keys than free rows (nothing changed).
        """
        n = keys.size
        if n > self.capacity - self.live:
            raise ResourceExhaustedError(
                f"{n} new keys but {self.capacity - self.live} free rows of {self.capacity}")
        if self._old is not None:
            self._move(max(self.move_min, MOVE_PER_KEY * n))
        if (self.live + self._tombs + n) * 2 > self._slots.size:
            self._rebuild(self.live + n)
        elif self._old is None and (self.live + self._tombs + n) * 16 > self._slots.size * 7:
            self._prepare_spare(n)
        reuse = min(n, self._nfree)
        rows = np.empty(n, np.int64)
        rows[:reuse] = self._free[self._nfree - reuse:self._nfree][::-1]
        self._nfree -= reuse
        rows[reuse:] = np.arange(self._next_row, self._next_row + n - reuse)
        at = slice(self._next_row, self._next_row + n) if not reuse else rows  # fresh rows: one run, no index
        self._next_row += n - reuse
        self.row_keys[at] = keys
        self.row_live[at] = True
        fresh = self.live == 0 and self._tombs == 0 and self._old is None  # every slot empty
        (self._place_fresh if fresh and n else self._place)(keys, rows)
        self.live += n
        return rows

    def remove(self, rows: np.ndarray) -> np.ndarray:
        """Free live rows (unique); returns their keys. Their slots become tombstones."""
        keys = self.row_keys[rows].copy()
        pos = self._find(keys)[0]
        self._slots[pos[pos >= 0]] = _TOMB
        self._tombs += int(np.count_nonzero(pos >= 0))
        if self._old is not None:  # a key not moved yet is only there
            old_pos = self._find(keys, self._old)[0]
            self._old[old_pos[old_pos >= 0]] = _TOMB
        self.row_live[rows] = False
        self._free[self._nfree:self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.live -= rows.size
        return np.asarray(keys)

    def _place(self, keys: np.ndarray, rows: np.ndarray, spread: bool = False) -> None:
        """Put absent keys' rows into the first free (empty or deleted) slot of their chains: one slot
        per key a round while many are left, then WINDOW slots a round for the last TAIL (as _find)."""
        slots = self._slots
        mask = slots.size - 1
        h = mix64(keys)
        pos = home_slot(h, slots.size)
        tag = self._tags(h) | (rows + 1).astype(np.int32)  # unique per row: who won a slot reads back
        if pos.size > TAIL:  # skip the taken slots of each home bucket in one read (keys share homes)
            free = (slots.reshape(-1, BUCKET).take(pos >> _BUCKET_BITS, axis=0) <= 0).view(_U8).reshape(pos.size)
            pos += _first(free)  # the next bucket's first slot where none is free
            if spread:
                pos = _spread(pos)
            pos &= mask
        while pos.size:
            if pos.size > TAIL:
                cand, skip = pos, None
            else:  # the first free slot of each key's window; a window with none is skipped whole
                win = (pos[:, None] + _STEPS) & mask
                free_w = slots[win] <= 0
                cand, skip = win[np.arange(pos.size), free_w.argmax(axis=1)], ~free_w.any(axis=1)
            before = slots[cand]
            free = before <= 0
            # keys of one batch may want the same free slot: scatter all, then read back who won
            at = cand[free]
            slots[at] = tag[free]
            won = np.zeros(pos.size, np.bool_)
            won[free] = slots[at] == tag[free]
            self._tombs -= int(np.count_nonzero(before[won] == _TOMB))
            lost = ~won
            nxt = cand + 1 if skip is None else np.where(skip, pos + WINDOW, cand + 1)
            pos, tag = nxt[lost] & mask, tag[lost]

    def _place_fresh(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """_place into a slot table with every slot empty (a restore, a first batch) without probing.

        Keys in order of their home slot take max(home, previous position + 1): the slots from a key's
        home to its position are then all taken, which is what linear probing needs. One sort of packed
        (home, index) values and a running maximum replace the rounds of _place (1.6-1.9 s for 2 M keys
        of a restore here). Keys pushed past the end wrap around through _place.
        """
        slots = self._slots
        n, size = keys.size, slots.size
        idx_bits = max(1, (n - 1).bit_length())
        # in place where it can: at millions of keys (a restore) each temporary costs its page faults
        h = mix64(keys)
        tag = self._tags(h)
        tag += rows.astype(np.int32)
        tag += np.int32(1)  # tag | row + 1: the tag's bits are above the row's
        packed = h
        packed &= np.uint64(size // BUCKET - 1)
        packed <<= np.uint64(_BUCKET_BITS + idx_bits)  # (home slot, index) in one sortable value
        packed |= np.arange(n, dtype=np.uint64)
        packed.sort()
        pos = (packed >> np.uint64(idx_bits)).view(np.int64)
        order = packed.view(np.int64)
        order &= (1 << idx_bits) - 1
        step = np.arange(n, dtype=np.int64)
        pos -= step
        np.maximum.accumulate(pos, out=pos)
        pos += step  # strictly increasing: the keys that fit are a prefix
        fit = int(np.searchsorted(pos, size))
        np.put(slots, pos[:fit], tag.take(order[:fit]), mode="clip")
        if fit < n:
            rest = order[fit:]
            self._place(keys[rest], rows[rest])

    def _rebuild(self, need: int) -> None:
        """Start moving into a fresh slot table for `need` live keys (a load of 1/5 to 2/5, no tombstones)."""
        if self._old is not None:
            self._move(self._old.size)  # the previous move first (rare: moves outpace inserts)
        size = max(MIN_SLOTS, _pow2(need * 5 // 2))
        self._old, self._cursor = self._slots, 0
        spare, self._spare = self._spare, None
        self._slots = spare if spare is not None and spare.size == size else np.zeros(size, np.int32)
        self._tombs = 0
        self.rebuilds += 1
        if self._old.size <= self.move_min:
            self._move(self._old.size)

    def _move(self, count: int) -> None:
        """Move the next `count` old slots' keys into the current table."""
        old = self._old
        assert old is not None
        end = min(old.size, self._cursor + count)
        part = old[self._cursor:end]
        rows = (part[part > 0] & self._row_mask).astype(np.int64) - 1
        if rows.size:
            self._place(self.row_keys[rows], rows, spread=True)  # several keys a bucket: see _spread
        part[part > 0] = _TOMB  # keeps the old probe chains of keys still to move intact
        self._cursor = end
        if end == old.size:
            self._old = None

    def advance(self, n: int) -> None:
        """Move MOVE_PER_KEY old slots per key of a batch of n that inserted nothing (a no-op unless a
        move is under way): until the move ends, a key not moved yet is looked up in both tables."""
        if self._old is not None and n:
            self._move(MOVE_PER_KEY * n)

    def _prepare_spare(self, n: int) -> None:
        """Write the next stretch of the table a growing index moves into next (2 x this one's size, all of
        it within the last 1/16 of this one's slots filled before the move), so its pages are committed by
        then. It exists only while the load is between 7/16 and 1/2: 8 bytes per slot of this table."""
        size = self._slots.size * 2
        if self._spare is None or self._spare.size != size:
            self._spare, self._spare_done = np.zeros(size, np.int32), 0
        end = min(size, self._spare_done + max(self.move_min, 32 * n))
        self._spare[self._spare_done:end] = _EMPTY
        self._spare_done = end

    def clear(self) -> None:
        """Forget every key (rows and slots back to empty)."""
        self.row_live[:self._next_row] = False
        self._next_row = self._nfree = self.live = self._tombs = 0
        self._slots = np.zeros(MIN_SLOTS, np.int32)
        self._old = self._spare = None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
