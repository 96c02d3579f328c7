"""The replica table (coordinator/replicas.py): placement, failover and rejoin decided from events alone."""

from __future__ import annotations

import pytest
from pscluster.coordinator import replicas as rp

from pscluster.errors import InvalidArgumentError


def table(num_ps: int, shards: int) -> rp.ReplicaState:
    state = rp.ReplicaState(num_ps)
    for k in range(shards):
        rp.decide(state, rp.ShardCreated(k))
        rp.decide(state, rp.CaughtUp(k, 1))  # the primary sent the new shard to its backup
    return state


def test_backups_are_striped_over_every_other_ps() -> None:
    state = table(4, 12)
    for k, c in state.shards.items():
        assert c.primary == k % 4 and c.backup != c.primary and c.in_sync and c.epoch == 1
    backups_of_ps0 = {c.backup for k, c in state.shards.items() if c.primary == 0}
    assert backups_of_ps0 == {1, 2, 3}


def test_one_ps_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="at least 2 PS"):
        rp.ReplicaState(1)


def test_a_new_shard_is_not_promoted_before_its_backup_confirmed_it() -> None:
    state = rp.ReplicaState(2)
    actions = rp.decide(state, rp.ShardCreated(0))
    assert rp.Assign(0, rp.Copies(0, 1, 1), True) in actions
    rp.decide(state, rp.ConnectionLost(0))
    assert state.shards[0].lost


def test_creating_a_shard_again_changes_nothing() -> None:
    state = table(2, 1)
    version = state.version
    assert rp.decide(state, rp.ShardCreated(0)) == []
    assert state.version == version


def test_dead_primary_promotes_its_in_sync_backup_with_a_new_epoch() -> None:
    state = table(3, 6)
    before = dict(state.shards)
    actions = rp.decide(state, rp.ConnectionLost(0))
    for k, c in before.items():
        after = state.shards[k]
        if c.primary == 0:
            assert after.primary == c.backup and after.epoch > c.epoch and not after.lost
        if 0 in (c.primary, c.backup):
            assert after.backup not in (None, 0, after.primary)  # replication restored on the survivors
            assert not after.in_sync  # ... once the new backup caught up
    assert isinstance(actions[-1], rp.Publish)
    assert not any(isinstance(a, rp.Lost) for a in actions)


def test_missed_heartbeats_mark_a_ps_down_after_three_intervals() -> None:
    state = table(2, 2)
    for ps in (0, 1):
        rp.decide(state, rp.Heartbeat(ps, 1.0))
    assert rp.decide(state, rp.Tick(1.0 + 3 * rp.HEARTBEAT_INTERVAL_S - 0.01)) == []
    rp.decide(state, rp.Heartbeat(1, 1.3))
    actions = rp.decide(state, rp.Tick(1.0 + 3 * rp.HEARTBEAT_INTERVAL_S + 0.01))
    assert state.up() == [1]
    assert state.shards[0].primary == 1 and state.shards[1].primary == 1
    assert any(isinstance(a, rp.Assign) for a in actions)


def test_backup_not_caught_up_is_not_promoted_and_the_shard_is_lost() -> None:
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(1))  # shard 0's backup (1) dies: a new backup starts catching up
    c = state.shards[0]
    assert c.backup is not None and not c.in_sync
    actions = rp.decide(state, rp.ConnectionLost(0))
    assert state.shards[0].lost
    assert rp.Lost(0, state.shards[0].epoch) in actions


def test_a_lost_shard_comes_back_on_its_catching_up_backup_only_after_a_restart() -> None:
    """Its primary died while its backup was catching up: the backup holds part of the shard or none. Marked
    down for missed heartbeats and back without a restart, it must not be made the primary of what it holds
    (a partial copy, silently); restarted, it loads the checkpoint; the primary back without a restart holds it
    whole."""
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(1))
    backup = state.shards[0].backup
    assert backup == 2 and not state.shards[0].in_sync
    rp.decide(state, rp.ConnectionLost(0))
    assert state.shards[0].lost and state.shards[0].backup == 2
    rp.decide(state, rp.ConnectionLost(2))  # the backup too (missed heartbeats), then it answers again
    actions = rp.decide(state, rp.Rejoined(2, 5.0, restarted=False))
    assert not any(isinstance(a, rp.Restored) and a.ordinal == 0 for a in actions) and state.shards[0].lost
    actions = rp.decide(state, rp.Rejoined(0, 6.0, restarted=False))  # its primary, whole
    assert [a.ps for a in actions if isinstance(a, rp.Restored) and a.ordinal == 0] == [0]
    assert state.shards[0].primary == 0 and not state.shards[0].lost


def test_a_lost_shard_comes_back_on_its_restarted_catching_up_backup_from_the_checkpoint() -> None:
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(1))
    rp.decide(state, rp.ConnectionLost(0))
    rp.decide(state, rp.ConnectionLost(2))
    actions = rp.decide(state, rp.Rejoined(2, 5.0, restarted=True))
    assert [a.ps for a in actions if isinstance(a, rp.Restored) and a.ordinal == 0] == [2]
    assert state.shards[0].primary == 2 and not state.shards[0].lost


def test_caught_up_backup_is_promoted() -> None:
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(1))
    c = state.shards[0]
    assert rp.decide(state, rp.CaughtUp(0, c.epoch)) == [rp.Publish(state.version)]
    assert state.shards[0].in_sync
    rp.decide(state, rp.ConnectionLost(0))
    assert state.shards[0].primary == c.backup and not state.shards[0].lost


def test_catch_up_of_an_older_epoch_is_ignored() -> None:
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(1))
    old = state.shards[0].epoch
    rp.decide(state, rp.ConnectionLost(2))  # the catching-up backup died too: another configuration
    assert rp.decide(state, rp.CaughtUp(0, old)) == []


def test_both_copies_gone_waits_for_a_restart_and_is_restored_there() -> None:
    state = table(2, 2)
    rp.decide(state, rp.ConnectionLost(0))  # every shard now on PS 1, without a backup
    assert all(c.primary == 1 and c.backup is None for c in state.shards.values())
    actions = rp.decide(state, rp.ConnectionLost(1))
    assert all(c.lost for c in state.shards.values())
    assert {a.ordinal for a in actions if isinstance(a, rp.Lost)} == {0, 1}
    actions = rp.decide(state, rp.Rejoined(1, 5.0))
    assert {a.ordinal for a in actions if isinstance(a, rp.Restored)} == {0, 1}
    assert all(c.primary == 1 and not c.lost for c in state.shards.values())


def test_restarted_ps_rejoins_as_backup() -> None:
    state = table(2, 4)
    rp.decide(state, rp.ConnectionLost(1))
    assert all(c.primary == 0 and c.backup is None for c in state.shards.values())
    actions = rp.decide(state, rp.Rejoined(1, 2.0))
    assigned = [a for a in actions if isinstance(a, rp.Assign)]
    assert len(assigned) == 4 and all(a.catch_up and a.copies.backup == 1 for a in assigned)
    for a in assigned:
        rp.decide(state, rp.CaughtUp(a.ordinal, a.copies.epoch))
    assert all(c.in_sync and c.backup == 1 for c in state.shards.values())


def test_new_backups_go_to_the_least_loaded_survivor() -> None:
    state = table(4, 16)
    rp.decide(state, rp.ConnectionLost(3))
    load = {ps: sum(1 for c in state.shards.values() if c.backup == ps) for ps in state.up()}
    assert max(load.values()) - min(load.values()) <= 1


def test_events_about_a_ps_already_down_change_nothing() -> None:
    state = table(3, 3)
    rp.decide(state, rp.ConnectionLost(2))
    snapshot, version = dict(state.shards), state.version
    assert rp.decide(state, rp.ConnectionLost(2)) == []
    assert rp.decide(state, rp.Heartbeat(2, 9.0)) == []
    assert state.shards == snapshot and state.version == version


def test_replicas_2_with_one_ps_is_a_config_error_that_names_the_field() -> None:
    from pydantic import ValidationError

    from pscluster.config import validate

    assert validate({"cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]}, "replicas": 2}).replicas == 2
    assert validate({"cluster": {"ps": ["127.0.0.1:1"]}}).replicas == 1
    with pytest.raises((ValidationError, ValueError), match="replicas=2 needs at least 2 PS tasks"):
        validate({"cluster": {"ps": ["127.0.0.1:1"]}, "replicas": 2})
    with pytest.raises((ValidationError, ValueError), match="replicas"):
        validate({"cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, "replicas": 3})


def test_elastic_turns_the_replica_table_on_for_one_copy() -> None:
    from pydantic import ValidationError

    from pscluster.config import validate

    one = {"cluster": {"ps": ["127.0.0.1:1"]}}
    assert not validate(one).replica_table  # replicas: 1 places by k mod P unless elastic
    assert validate({**one, "elastic": True}).replica_table and validate({**one, "elastic": True}).replicas == 1
    assert validate({"cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]}, "replicas": 2}).replica_table
    with pytest.raises((ValidationError, ValueError), match="elastic"):
        validate({**one, "elastic": "sometimes"})


def test_an_elastic_reassign_bumps_the_epoch_and_the_new_backup_catches_up() -> None:
    state = table(3, 3)
    c = state.shards[0]
    actions = rp.decide(state, rp.Reassign(0, c.primary, 2, c.epoch))
    after = state.shards[0]
    assert after == rp.Copies(c.primary, 2, c.epoch + 1)  # not in sync until the catch-up finished
    assert rp.Assign(0, after, True) in actions and isinstance(actions[-1], rp.Publish)
    rp.decide(state, rp.CaughtUp(0, after.epoch))
    switched = rp.decide(state, rp.Reassign(0, 2, c.primary, after.epoch))  # the switch: the successor is primary
    assert state.shards[0].primary == 2 and state.shards[0].epoch == c.epoch + 2
    assert rp.Assign(0, state.shards[0], True) in switched


def test_a_reassign_of_an_unknown_or_lost_shard_onto_one_ps_or_a_dead_one_changes_nothing() -> None:
    state = table(3, 3)
    version = state.version
    assert rp.decide(state, rp.Reassign(9, 0, 1, 1)) == []
    assert rp.decide(state, rp.Reassign(0, 1, 1, 1)) == []
    state.shards[1] = rp.Copies(1, 2, 5, lost=True)
    assert rp.decide(state, rp.Reassign(1, 0, 2, 5)) == []
    state.ps[2].up = False  # the successor died between the freeze and the switch
    assert rp.decide(state, rp.Reassign(0, 2, 1, 1)) == []
    assert state.version == version


def test_a_switch_makes_primary_only_the_in_sync_backup_at_the_epoch_that_was_frozen() -> None:
    state = table(3, 3)
    c = state.shards[0]  # primary 0, backup 1, in sync, epoch 1
    assert (c.primary, c.backup, c.in_sync) == (0, 1, True)
    before, version = dict(state.shards), state.version
    # a failover or another move changed the shard after the executor read it: its epoch moved on
    assert rp.decide(state, rp.Reassign(0, 1, 2, c.epoch + 1)) == []
    assert rp.decide(state, rp.Reassign(0, 1, 2, c.epoch - 1)) == []
    # the new primary must be the backup that holds everything the old one acknowledged
    assert rp.decide(state, rp.Reassign(0, 2, 1, c.epoch)) == []
    state.shards[0] = rp.Copies(0, 1, c.epoch)  # the backup has not finished catching up
    assert rp.decide(state, rp.Reassign(0, 1, 2, c.epoch)) == []
    assert state.shards[0] == rp.Copies(0, 1, c.epoch) and state.version == version
    state.shards[0] = before[0]
    assert rp.decide(state, rp.Reassign(0, 1, 2, c.epoch))  # the in-sync backup at the frozen epoch
    assert state.shards[0] == rp.Copies(1, 2, c.epoch + 1)
    # a backup-only change needs no sync, only the epoch the executor read
    assert rp.decide(state, rp.Reassign(0, 1, 0, c.epoch)) == []
    assert rp.decide(state, rp.Reassign(0, 1, 0, c.epoch + 1))


def test_a_drained_ps_gets_no_new_backup_after_a_failover() -> None:
    state = rp.ReplicaState(4)
    state.inactive = {3}  # a scale drained it: nothing lives there
    state.shards = {0: rp.Copies(0, 1, 1, in_sync=True), 1: rp.Copies(1, 2, 1, in_sync=True),
                    2: rp.Copies(2, 0, 1, in_sync=True)}
    rp.decide(state, rp.ConnectionLost(0))
    assert state.shards[0].primary == 1 and state.shards[2].primary == 2
    assert all(c.backup is not None and 3 not in (c.primary, c.backup) for c in state.shards.values())


def test_the_sync_state_row_starts_on_ps_0_and_fails_over_and_rejoins_like_a_shard() -> None:
    state = table(3, 3)
    assert rp.decide(state, rp.ShardCreated(rp.SYNC_ORDINAL))[0] == rp.Assign(rp.SYNC_ORDINAL, rp.Copies(0, 1, 1), True)
    rp.decide(state, rp.CaughtUp(rp.SYNC_ORDINAL, 1))
    rp.decide(state, rp.ConnectionLost(0))  # PS 0 dies: its backup holds the token queue now
    moved = state.shards[rp.SYNC_ORDINAL]
    assert moved.primary == 1 and moved.epoch > 1 and moved.backup == 2 and not moved.in_sync
    rp.decide(state, rp.CaughtUp(rp.SYNC_ORDINAL, moved.epoch))
    rp.decide(state, rp.ConnectionLost(1))  # and then its new primary: the in-sync backup again
    assert state.shards[rp.SYNC_ORDINAL].primary == 2 and not state.shards[rp.SYNC_ORDINAL].lost
    actions = rp.decide(state, rp.Rejoined(0, 5.0))
    now = state.shards[rp.SYNC_ORDINAL]
    assert (now.primary, now.backup) == (2, 0)  # the restarted PS 0 catches up as its backup
    assert rp.Assign(rp.SYNC_ORDINAL, now, True) in actions


# -- one copy (replicas: 1, elastic) ------------------------------------------------------------------
def test_one_copy_gives_no_backups_and_a_dead_primary_loses_its_shards_to_the_checkpoint() -> None:
    assert rp.ReplicaState(1, copies=1).up() == [0]  # one PS is enough
    state = rp.ReplicaState(2, copies=1)
    for k in range(4):
        rp.decide(state, rp.ShardCreated(k))
    rp.decide(state, rp.ShardCreated(rp.SYNC_ORDINAL))
    assert {o: (c.primary, c.backup) for o, c in state.shards.items()} == \
        {0: (0, None), 1: (1, None), 2: (0, None), 3: (1, None), rp.SYNC_ORDINAL: (0, None)}
    actions = rp.decide(state, rp.ConnectionLost(1))
    assert [a for a in actions if isinstance(a, rp.Lost)] == [rp.Lost(1, 2), rp.Lost(3, 2)]
    assert not any(isinstance(a, rp.Assign) for a in actions)  # nobody gets a backup
    actions = rp.decide(state, rp.Rejoined(1, 5.0))
    assert [a for a in actions if isinstance(a, rp.Restored)] == [rp.Restored(1, 1, 3), rp.Restored(3, 1, 3)]
    assert all(c.backup is None and not c.lost for c in state.shards.values())


def test_one_copy_a_move_is_a_temporary_backup_then_a_switch_to_it_once_in_sync() -> None:
    state = rp.ReplicaState(3, copies=1)
    rp.decide(state, rp.ShardCreated(0))
    [assign, _] = rp.decide(state, rp.Reassign(0, 0, 2, 1))
    assert assign == rp.Assign(0, rp.Copies(0, 2, 2), True)  # the successor catches up as backup
    assert rp.decide(state, rp.Reassign(0, 2, None, 2)) == []  # not in sync yet: no switch
    rp.decide(state, rp.CaughtUp(0, 2))
    [assign, _] = rp.decide(state, rp.Reassign(0, 2, None, 2))
    assert assign == rp.Assign(0, rp.Copies(2, None, 3), False)
    rp.decide(state, rp.ConnectionLost(0))  # the old holder dies: the moved shard is not touched
    assert state.shards[0] == rp.Copies(2, None, 3)


def test_copies_other_than_1_or_2_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="copies must be 1 or 2, got 3"):
        rp.ReplicaState(3, copies=3)
    with pytest.raises(InvalidArgumentError, match="at least 2 PS tasks"):
        rp.ReplicaState(1, copies=2)
