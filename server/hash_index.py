"""An open-addressing hash index: int64 key -> row id, with the row ids it hands out.

Why not a dict: a Python dict costs about 98 bytes per int key and one interpreter step per key; this
index costs 4 bytes per slot (8 to 20 per key at its load of 1/5 to 1/2) plus the key itself, and
probes whole batches in compiled loops (server/table_kernels.py): one bucket read, one tag compare and
one key read settle nearly every key.

The slot table holds `tag | row + 1` (0 = empty, -1 = deleted), never a key, so every int64 key is
valid (0, -1 and 2**63-1 included): there is no key sentinel to collide with. A slot's key is read from
`row_keys[row]`; the tag (bits of the key's hash above the row id's bits, as many as fit in 31) lets a
lookup skip the other keys' slots without reading their keys. Linear probing from the first slot of the
key's bucket of BUCKET slots (32 bytes, `mix64(key)`'s low bits pick it). Deletion leaves a tombstone,
and the table is replaced (by one of 2.5 x its live keys, rounded up to a power of two) when live
entries plus tombstones pass half of it. The move is incremental, so growing never stops the shard for
a whole rehash: the old table stays searchable while each insert moves a bounded stretch of it
(MOVE_PER_KEY old slots per new key, at least MOVE_MIN), which finishes the move before the new table
can fill. The next table's pages are written (committed) a stretch per insert while the load climbs
from 7/16 to 1/2, so the batch that starts a move does not take a page fault for each of its keys
(138 ms of a batch of 65,536 at 8 M keys here).

Row ids are dense in [0, capacity): a freed row is reused by a later insert, so arrays indexed by row
(values, slots, metadata) never grow past the capacity and hold one key's state per row id.

    index = HashIndex(capacity=1 << 20)
    rows = index.insert(np.array([7, -1], np.int64))   # keys known to be absent
    index.lookup(np.array([-1, 5], np.int64))          # -> [rows[1], -1]
"""

from __future__ import annotations

import numpy as np
from pscluster.server import table_kernels as kernels
from pscluster.server.rows import zeros

from pscluster.errors import InvalidArgumentError, ResourceExhaustedError
from pscluster.tables import mix64 as mix64
from pscluster.tables import shard_of as shard_of

_EMPTY = 0
MIN_SLOTS = 1024
# old slots moved per inserted key: while growing, a move of S old slots has S/2 inserts before the next
# one starts (16: gone after S/16, so a table is rarely left mid-move; 8 halved the longest batch but left
# a table grown to 10 M keys mid-move, searching two slot tables); churn with tombstones can start a move
# sooner, which finishes the last one first. Reads and updates of existing keys move as many per key too
# (advance), so a table that stops growing mid-move does not look keys up in two tables for good.
MOVE_PER_KEY = 16
MOVE_MIN = 1 << 16
_BUCKET_BITS = 3
BUCKET = 1 << _BUCKET_BITS  # slots of a key's home bucket (32 bytes): homes are bucket-aligned
_NO_TABLE = np.zeros(0, np.int32)  # lookup's "old" table when no move is under way


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
        self._tag_mask = (1 << self.tag_bits) - 1
        # zeros at capacity: the OS commits pages on first touch, so rows never move or get copied
        self.row_keys = zeros(capacity, np.int64)  # huge pages: a lookup's read of a key misses no TLB
        self.row_live = zeros(capacity, np.bool_)
        self._free = zeros(capacity, np.int32)  # a stack of freed row ids
        self._nfree = 0
        self._next_row = 0
        self.live = 0
        self._tombs = 0
        self._slots = zeros(max(BUCKET, _pow2(slots)), np.int32)  # a home is a whole bucket
        self._old: np.ndarray | None = None  # the slot table being moved out of, searched after _slots
        self._cursor = 0  # old slots below it are moved (tombstones now)
        self._spare: np.ndarray | None = None  # the next slot table, its pages committed below _spare_done
        self._spare_done = 0
        self.move_min = move_min
        self.rebuilds = 0
        kernels.load()

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

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Row id of each key (int64), -1 where the key is absent."""
        return self.find(keys)[0]

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(lookup's row ids, how many keys are absent): a caller that branches on "all found" needs no
        pass of its own over the rows."""
        old = _NO_TABLE if self._old is None else self._old  # keys not moved yet are only in the old table
        return kernels.find(self._slots, old, self.row_keys, keys, self._row_bits, self._tag_mask)

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
        self._tombs -= kernels.place(self._slots, keys, rows, self._row_bits, self._tag_mask)
        self.live += n
        return rows

    def remove(self, rows: np.ndarray) -> np.ndarray:
        """Free live rows (unique); returns their keys. Their slots become tombstones."""
        keys = self.row_keys[rows].copy()
        self._tombs += kernels.erase(self._slots, self.row_keys, keys, self._row_bits, self._tag_mask)
        if self._old is not None:  # a key not moved yet is only there
            kernels.erase(self._old, self.row_keys, keys, self._row_bits, self._tag_mask)
        self.row_live[rows] = False
        self._free[self._nfree:self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.live -= rows.size
        return np.asarray(keys)

    def _rebuild(self, need: int) -> None:
        """Start moving into a fresh slot table for `need` live keys (a load of 1/5 to 2/5, no tombstones)."""
        if self._old is not None:
            self._move(self._old.size)  # the previous move first (rare: moves outpace inserts)
        size = max(MIN_SLOTS, _pow2(need * 5 // 2))
        self._old, self._cursor = self._slots, 0
        spare, self._spare = self._spare, None
        self._slots = spare if spare is not None and spare.size == size else zeros(size, np.int32)
        self._tombs = 0
        self.rebuilds += 1
        if self._old.size <= self.move_min:
            self._move(self._old.size)

    def _move(self, count: int) -> None:
        """Move the next `count` old slots' keys into the current table."""
        old = self._old
        assert old is not None
        end = min(old.size, self._cursor + count)
        self._tombs -= kernels.move(old, self._cursor, end, self._slots, self.row_keys, self._row_bits)
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
            self._spare, self._spare_done = zeros(size, np.int32), 0
        end = min(size, self._spare_done + max(self.move_min, 32 * n))
        self._spare[self._spare_done:end] = _EMPTY
        self._spare_done = end

    def clear(self) -> None:
        """Forget every key (rows and slots back to empty)."""
        self.row_live[:self._next_row] = False
        self._next_row = self._nfree = self.live = self._tombs = 0
        self._slots = zeros(MIN_SLOTS, np.int32)
        self._old = self._spare = None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
