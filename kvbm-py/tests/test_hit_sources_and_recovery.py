"""The connector's answers to vLLM beyond the load plan: where each hit comes from
(``get_external_cache_hit_sources``, vllm/v1/core/sched/scheduler.py calls it right after
``update_state_after_alloc`` and requires the counts to add up), and the warm restart's
recovery files (kvbm.recovery)."""

import json
import os
from types import SimpleNamespace as NS

import pytest

import kvbm
from kvbm.leader import KvbmLeader
from kvbm.recovery import read_agreed, recovered_path, write_recovered

B = 4


def blocks_of(tokens):
    hashes = kvbm.sequence_hashes(tokens, B)
    return [(h, hashes[i - 1] if i else None, tokens[B * i : B * i + B]) for i, h in enumerate(hashes)]


def request(rid, tokens):
    return NS(request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, num_tokens=len(tokens),
              cache_salt=None, lora_request=None)


def leader_with_host_then_disk():
    """A leader whose host tier holds blocks 0-3 of a prompt and whose disk tier holds 0-7."""
    leader = KvbmLeader(B, 8, disk_blocks=32, disk_filter_disabled=True)
    tokens = list(range(1000, 1000 + 8 * B + 1))
    chain = blocks_of(tokens[: 8 * B])
    native = leader.native
    native.offload(chain[4:])  # offloaded first: evicted first
    native.offload(chain[:4])
    native.take_disk_writes()  # all eight on disk
    for _ in range(3):  # past the steps handed-out blocks stay held
        native.end_step()
    other = blocks_of(list(range(5000, 5000 + 4 * B)))
    native.offload(other)  # the host tier (8 blocks) evicts blocks 4-7
    native.take_disk_writes()  # admitted blocks are held until written
    for _ in range(3):  # the new blocks can stage disk reads again
        native.end_step()
    return leader, tokens


def test_hits_are_split_host_first_then_disk_and_add_up():
    leader, tokens = leader_with_host_then_disk()
    req = request("r", tokens)
    found, is_async = leader.get_num_new_matched_tokens(req, 0)
    assert (found, is_async) == (8 * B, True)
    leader.update_state_after_alloc(req, ([10 + i for i in range(9)],), found)
    assert leader.hit_sources(req, found) == {"host": 4 * B, "disk": 4 * B}
    # vLLM may grant fewer than found: host blocks come first.
    assert leader.hit_sources(req, 3 * B) == {"host": 3 * B}
    assert leader.hit_sources(req, 0) == {}


def test_a_host_only_hit_is_all_host_and_an_unplanned_one_unspecified():
    leader = KvbmLeader(B, 8)
    tokens = list(range(2000, 2000 + 4 * B + 1))
    leader.native.offload(blocks_of(tokens[: 4 * B]))
    req = request("h", tokens)
    found, is_async = leader.get_num_new_matched_tokens(req, 0)
    assert (found, is_async) == (4 * B, False)
    leader.update_state_after_alloc(req, ([1, 2, 3, 4, 5],), found)
    assert leader.hit_sources(req, found) == {"host": 4 * B}
    # A request kvbm planned nothing for (vLLM granted 0 before): nothing to attribute.
    assert leader.hit_sources(request("never-seen", tokens), 8) == {"external_unspecified": 8}


def test_connector_returns_vllms_cache_hit_source_keys():
    from kvbm.vllm_integration.connector import _as_cache_hit_sources

    got = _as_cache_hit_sources({"host": 3, "disk": 5})
    # With vLLM installed its CacheHitSource members (a str enum), else the same strings.
    assert {str(getattr(k, "value", k)): v for k, v in got.items()} == {"host": 3, "disk": 5}


# -- recovery files ---------------------------------------------------------------------------


def test_only_blocks_every_rank_holds_alike_are_agreed(tmp_path):
    a = [(0, 11, b"x"), (1, 12, b"y"), (2, 13, b"z")]
    b = [(0, 11, b"x"), (1, 12, b"other identity"), (2, 13, b"z"), (3, 14, b"w")]
    write_recovered(str(tmp_path), 0, "inst", a)
    write_recovered(str(tmp_path), 1, "inst", b)
    assert oct(os.stat(recovered_path(str(tmp_path), 0)).st_mode & 0o777) == "0o600"
    agreed, why = read_agreed(str(tmp_path), 2, "inst")
    assert why == "" and agreed == [(0, 11, b"x"), (2, 13, b"z")]


def test_a_missing_rank_another_instance_or_a_bad_file_adopts_nothing(tmp_path):
    d = str(tmp_path)
    write_recovered(d, 0, "inst", [(0, 1, b"x")])
    assert read_agreed(d, 2, "inst")[0] == []
    assert "rank 1" in read_agreed(d, 2, "inst")[1]
    assert "another vLLM instance" in read_agreed(d, 1, "other")[1]
    with open(recovered_path(d, 0), "w") as f:
        json.dump({"format": "kvbm-recovered-v1", "instance": "inst", "rank": 0, "blocks": [[-1, 5, "eA=="]]}, f)
    agreed, why = read_agreed(d, 1, "inst")
    assert agreed == [] and "malformed" in why
    with open(recovered_path(d, 0), "w") as f:
        f.write("{not json")
    assert "malformed" in read_agreed(d, 1, "inst")[1]
    # A key named twice is not a file kvbm wrote.
    write_recovered(d, 0, "inst", [(0, 1, b"x"), (1, 1, b"x")])
    assert "twice" in read_agreed(d, 1, "inst")[1]


def test_a_symlinked_recovery_file_is_not_followed(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"format": "kvbm-recovered-v1", "instance": "i", "rank": 0, "blocks": []}))
    os.symlink(target, recovered_path(str(d), 0))
    agreed, why = read_agreed(str(d), 1, "i")
    assert agreed == [] and why


def test_the_leader_adopts_what_the_files_agree_on_and_announces_it(tmp_path):
    # Identities as a worker's disk file records them: written by a leader's disk writes.
    src = KvbmLeader(B, 8, disk_blocks=16, disk_filter_disabled=True)
    chain = blocks_of(list(range(3000, 3000 + 3 * B)))
    src.native.offload(chain)
    writes = src.native.take_disk_writes()
    entries = [(disk, key, bytes(identity)) for _host, disk, key, identity in writes]
    assert len(entries) == 3
    write_recovered(str(tmp_path), 0, "inst", entries)

    leader = KvbmLeader(B, 8, disk_blocks=16, recovery=(str(tmp_path), 1, "inst"))
    assert leader.adopted_disk_blocks == 3
    stored = [e for e in leader.take_events() if type(e).__name__ == "BlockStored"]
    assert [h for e in stored for h in e.block_hashes] == [h for h, _, _ in chain]
    assert {e.medium for e in stored} == {"DISK"}
    # A later prompt with that prefix is a disk hit.
    tokens = list(range(3000, 3000 + 3 * B + 1))
    found, is_async = leader.get_num_new_matched_tokens(request("after-restart", tokens), 0)
    assert (found, is_async) == (3 * B, True)

    # Without agreement (another instance) nothing is adopted and nothing announced.
    fresh = KvbmLeader(B, 8, disk_blocks=16, recovery=(str(tmp_path), 1, "another"))
    assert fresh.adopted_disk_blocks == 0
    assert fresh.get_num_new_matched_tokens(request("x", tokens), 0) == (0, False)


def test_recovery_files_that_could_hang_or_crash_the_leader_adopt_nothing(tmp_path):
    d = str(tmp_path)
    with open(recovered_path(d, 0), "w") as f:
        f.write('{"format": "kvbm-recovered-v1", "instance": "i", "rank": 0, "blocks": [[Infinity, 1, ""]]}')
    assert "malformed" in read_agreed(d, 1, "i")[1]
    os.unlink(recovered_path(d, 0))
    os.mkfifo(recovered_path(d, 0))  # would block a plain open forever
    agreed, why = read_agreed(d, 1, "i")
    assert agreed == [] and "regular file" in why
    os.unlink(recovered_path(d, 0))
    # Slots beyond the disk tier configured now (the file of a larger tier): nothing adopted,
    # and the leader still starts.
    write_recovered(d, 0, "i", [(40, 7, b"x")])
    leader = KvbmLeader(B, 8, disk_blocks=16, recovery=(d, 1, "i"))
    assert leader.adopted_disk_blocks == 0
    # An identity kvbm-core cannot read is dropped, not fatal.
    write_recovered(d, 0, "i", [(3, 7, b"not an identity")])
    assert KvbmLeader(B, 8, disk_blocks=16, recovery=(d, 1, "i")).adopted_disk_blocks == 0
