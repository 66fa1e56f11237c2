"""Single-object Avro as a Faust codec: `value_serializer="astraflow"` gives agents typed records.

    import faust
    import stream_apps.codec  # registers the codec

    app = faust.App("my-app", broker="kafka://127.0.0.1:19092")
    rollouts = app.topic("af.exp.rollouts", value_serializer="astraflow")

    @app.agent(rollouts)
    async def count(stream):
        async for trajectory in stream:  # an astraflow.records.Trajectory
            ...

The codec wraps `astraflow.serde.AvroSerde` (the wire format of every AstraFlow topic: `C3 01`,
the 8-byte schema fingerprint, the Avro body), so a Faust agent reads exactly what the other
components write. AstraFlow's own apps (`stream_apps.engine`) consume raw bytes and decode with
the same serde inside the agent instead: a record that does not decode must reach the DLQ with
its reason and its original bytes, which Faust's decode-error path (log and skip) cannot do.
"""

from __future__ import annotations

from typing import Any

from faust.serializers import codecs

from astraflow.serde import AvroSerde

CODEC_NAME = "astraflow"


class AvroCodec(codecs.Codec):
    """Typed AstraFlow record <-> single-object Avro bytes."""

    def __init__(self, serde: AvroSerde | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.serde = serde or AvroSerde()

    def _dumps(self, obj: Any) -> bytes:
        return self.serde.dumps(obj)

    def _loads(self, s: bytes) -> Any:
        return self.serde.loads(s)


def register(serde: AvroSerde | None = None) -> AvroCodec:
    """Registers (or replaces) the `astraflow` codec; returns it."""
    codec = AvroCodec(serde)
    codecs.register(CODEC_NAME, codec)
    return codec


register()
