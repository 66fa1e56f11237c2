"""The WAN pieces that need no broker: the second listener's properties, the proxy's settings,
its byte counters, and refusals (secure + WAN, a missing Go toolchain, no proxy running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import LocalKafkaSettings, WanSettings
from astraflow.errors import LocalKafkaError, ToolMissingError, WanError
from astraflow.kafka.local import LocalKafka
from astraflow.kafka.wan import Wan

METRICS = """\
# TYPE toxiproxy_proxy_sent_bytes_total counter
toxiproxy_proxy_sent_bytes_total{direction="downstream",listener="127.0.0.1:27094",proxy="kafka-1",upstream="x"} 803325
toxiproxy_proxy_sent_bytes_total{direction="upstream",listener="127.0.0.1:27094",proxy="kafka-1",upstream="x"} 690
toxiproxy_proxy_received_bytes_total{direction="upstream",listener="127.0.0.1:27094",proxy="kafka-1",upstream="x"} 9
toxiproxy_proxy_sent_bytes_total{direction="downstream",listener="127.0.0.1:27096",proxy="kafka-2",upstream="y"} 1e+06
"""


def _props(k: LocalKafka, i: int) -> dict[str, str]:
    k._write_configs(k.nodes[i])
    return dict(line.split("=", 1) for line in k.nodes[i].properties.read_text().splitlines())


def test_wan_listener_advertises_the_proxy_on_every_node(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=29000, controller_port=29001, brokers=3,
                                      wan_proxy_port=29100))
    assert k.wan_bootstrap == "127.0.0.1:29100,127.0.0.1:29102,127.0.0.1:29104"
    props = _props(k, 1)
    assert props["listeners"].endswith(",WAN://127.0.0.1:29103")  # the broker's own port behind the proxy
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29002,WAN://127.0.0.1:29102"
    assert "WAN:PLAINTEXT" in props["listener.security.protocol.map"]
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # brokers talk to each other locally


def test_without_wan_there_is_one_client_listener(tmp_path: Path) -> None:
    k = LocalKafka(LocalKafkaSettings(data_dir=tmp_path, port=29000, controller_port=29001))
    assert k.wan_bootstrap is None
    assert "WAN" not in _props(k, 0)["listeners"]


def test_secure_and_wan_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(LocalKafkaError, match="plaintext cluster only"):
        LocalKafka(LocalKafkaSettings(data_dir=tmp_path, secure=True, wan_proxy_port=29100))


def test_byte_counters_are_read_per_proxy_and_direction(monkeypatch: pytest.MonkeyPatch) -> None:
    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return METRICS.encode()

    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: Resp())
    assert Wan(WanSettings()).bytes() == {"kafka-1": {"upstream": 690, "downstream": 803325},
                                          "kafka-2": {"upstream": 0, "downstream": 1_000_000}}


def test_missing_go_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _: None)
    monkeypatch.setattr("astraflow.kafka.wan.GO_FALLBACK", tmp_path / "no-go")
    with pytest.raises(ToolMissingError, match="install Go"):
        Wan(WanSettings(bin_dir=tmp_path)).install(echo=lambda *_: None)


def test_api_calls_without_a_proxy_say_how_to_start_it(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wan = Wan(WanSettings(data_dir=tmp_path, api_port=port))
    assert wan.pid() is None
    with pytest.raises(WanError, match="astraflow wan up"):
        wan.links()


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        WanSettings(rate_kb_s=0)
    with pytest.raises(ValueError):
        WanSettings(latency_ms=-1)


def test_cli_status_and_up_say_what_is_missing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from astraflow_cli.main import app

    sets = ["--set", f"wan.data_dir={tmp_path / 'wan'}", "--set", "wan.api_port=1"]
    r = CliRunner().invoke(app, [*sets, "wan", "status"])
    assert r.exit_code == 3 and "stopped" in r.output
    # A Kafka data directory formatted without the WAN listener: `wan up` says how to get one.
    (tmp_path / "kb").mkdir()
    (tmp_path / "kb" / "layout.json").write_text('{"brokers": 1, "secure": false, "port": 29000, "controller_port": 29001}')
    r = CliRunner().invoke(app, [*sets, "wan", "up", "--data-dir", str(tmp_path / "kb")])
    assert r.exit_code != 0 and "--wan-proxy-port" in r.output
