"""OffsetReader turns a list-offsets request that never answers into a KafkaLayerError.

Found with the compose stack: while its broker restarted, a future's own wait raised the builtin
TimeoutError, which the metrics bridge's refresh thread (it catches AstraflowError) did not
expect: the thread died and /metrics served the last report forever.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from confluent_kafka.admin import OffsetSpec

from astraflow.config import KafkaSettings
from astraflow.errors import AstraflowError
from astraflow.ops.cluster_offsets import OffsetReader


class _SilentAdmin:
    """list_offsets returns futures that are never completed (a broker that does not answer)."""

    def list_offsets(self, specs: dict, request_timeout: float) -> dict:
        return {tp: Future() for tp in specs}


def test_unanswered_offsets_request_is_an_astraflow_error() -> None:
    from confluent_kafka import TopicPartition

    reader = OffsetReader(KafkaSettings(bootstrap_servers="127.0.0.1:1"), timeout_s=0.1)
    reader.admin = _SilentAdmin()  # type: ignore[assignment]
    with pytest.raises(AstraflowError, match="no answer within"):
        reader._list({TopicPartition("t", 0): OffsetSpec.latest()})
