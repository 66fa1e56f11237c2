"""bench/_weight_tap.WeightTap on the real broker: collecting the weights stream during a run and
replaying it afterwards gives, at every evaluation mark, the same version and the same bits as
the `KafkaWeightFollower` loop `bench/_pipeline.run_pipeline` ran during the run before; a
corrupt chunk ends the replay with an error instead of wrong weights."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from _weight_tap import WeightTap
from weights_helpers import bits_equal

from astraflow.config import KafkaSettings
from astraflow.records import WeightChunk
from astraflow.weights.follow import KafkaWeightFollower
from astraflow.weights.publish import PublishSettings, WeightPublisher

pytestmark = pytest.mark.integration
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # settles TORCHINDUCTOR_CACHE_DIR before the leak guard

VERSIONS, EVERY = 9, 3  # versions 0..8; marks at 3, 6 and the last, 8


def _publish(publisher: WeightPublisher, versions: range) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(versions.stop):
        if step in versions:
            publisher.publish(model.state_dict(), trainer_step=step)
        loss = model(torch.randint(0, 64, (16,))).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_the_tap_replays_the_bits_the_follower_gave_at_every_mark(kafka: KafkaSettings, experiment: str) -> None:
    # fp32, chunks small enough that a version spans several; snapshots beside the stream now and then
    publisher = WeightPublisher(kafka, experiment, "policy", PublishSettings(snapshot_every=4, chunk_bytes=4096))
    assert publisher.start() is None
    _publish(publisher, range(0, 1))  # version 0 is out before the run starts, as in run_pipeline
    follower = KafkaWeightFollower(kafka, experiment, "policy", request_snapshots=False, requester="bench")
    tap = WeightTap(kafka, experiment)
    follower.start()
    tap.start()
    last = VERSIONS - 1
    before: dict[int, dict[str, torch.Tensor]] = {}  # what the follower held after each version
    try:
        _publish(publisher, range(1, VERSIONS))
        deadline = time.monotonic() + 60
        while ((follower.follower.version or 0) < last or (tap.version or 0) < last) and time.monotonic() < deadline:
            for event in follower.poll(0.2, max_records=1):  # one record at a time: every version's state
                before[event.version] = {k: v.detach().clone().float() for k, v in follower.follower.state.items()}
            tap.poll(0.2)
        assert tap.version == last and follower.follower.version == last
        snapshots, arrived = tap.replay(EVERY, last)
    finally:
        follower.close()
        tap.close()
    assert [v for v, _, _ in snapshots] == [3, 6, 8]
    for version, at, state in snapshots:
        assert bits_equal(state, before[version]) and at == arrived[version]
        assert all(t.dtype == torch.float32 for t in state.values())
    assert sorted(arrived) == list(range(VERSIONS))  # every version, the first one a snapshot in the stream
    assert list(arrived.values()) == sorted(arrived.values()) and arrived == {v: tap.arrived[v] for v in arrived}

    # a corrupt chunk (crc32 no longer matches): the replay stops with an error, no wrong weights
    i, (offset, chunk, at) = next((i, r) for i, r in enumerate(tap.records)
                                  if isinstance(r[1], WeightChunk) and r[1].version == 5)
    tap.records[i] = (offset, replace(chunk, data=bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]), at)
    with pytest.raises(RuntimeError, match="version 5"):
        tap.replay(EVERY, last)
