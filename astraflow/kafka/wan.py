"""A simulated WAN between region A's Kafka and region-B clients: Toxiproxy, installed and run by us.

`Wan.up(pairs)` makes sure the Toxiproxy server binary exists (`go install
github.com/Shopify/toxiproxy/v2/cmd/server@v<version>` into `wan.bin_dir`, once; the Go toolchain
from PATH or /usr/local/go/bin), starts it on `127.0.0.1:<wan.api_port>` with a pid file under
`wan.data_dir`, and configures one proxy per (listen port, upstream port) pair: latency
`wan.latency_ms` each way (RTT twice that) and a bandwidth cap of `wan.rate_kb_s` KB/s each way.
Toxiproxy applies the cap per connection, so a client with several connections to one broker
can use more (a Kafka client fetches weights on one connection per broker).

`Wan.bytes()` reads the server's per-proxy byte counters (`--proxy-metrics`), so a benchmark can
count what crossed the link. `down()` stops only the process its pid file names.

Kafka's side: `local_kafka.wan_proxy_port` gives each node a second listener advertised at the
proxy's address (`astraflow.kafka.nodes.server_properties`), so region-B clients, bootstrapped
at the proxy, only ever learn proxy addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config import WanSettings
from astraflow.errors import ToolMissingError, WanError
from astraflow.kafka.nodes import alive, stop_pid

Echo = Callable[..., Any]
GO_FALLBACK = Path("/usr/local/go/bin/go")
MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server"


@dataclass(frozen=True)
class Link:
    """One proxy: region B connects to `listen`, which forwards to `upstream` (both on 127.0.0.1)."""

    name: str
    listen: int
    upstream: int


class Wan:
    """The Toxiproxy server of `settings` and its proxies."""

    def __init__(self, settings: WanSettings) -> None:
        self.s = settings
        self.root = settings.data_dir.expanduser().resolve()
        self.pid_file = self.root / "toxiproxy.pid"
        self.binary = settings.bin_dir.expanduser().resolve() / f"toxiproxy-server-{settings.version}"
        self.api = f"http://127.0.0.1:{settings.api_port}"

    # ---- install -------------------------------------------------------------------------------

    def install(self, echo: Echo = print) -> Path:
        """The server binary, built with `go install` on first use (then cached)."""
        if self.binary.exists():
            return self.binary
        go = shutil.which("go") or (str(GO_FALLBACK) if GO_FALLBACK.exists() else None)
        if go is None:
            raise ToolMissingError("Toxiproxy is built with Go: install Go 1.21+ (https://go.dev/dl/, or "
                                   "`apt-get install golang`), or put a toxiproxy-server binary at " + str(self.binary))
        echo(f"Building Toxiproxy {self.s.version} with `go install` (first run only)...")
        self.binary.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.binary.parent) as tmp:
            env = {**os.environ, "GOBIN": tmp, "GOFLAGS": "-mod=mod"}
            res = subprocess.run([go, "install", f"{MODULE}@v{self.s.version}"], capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise WanError(f"`go install {MODULE}@v{self.s.version}` failed (is proxy.golang.org reachable, or "
                               f"GOPROXY set?):\n{(res.stdout + res.stderr)[-3000:]}")
            os.replace(Path(tmp) / "server", self.binary)
        return self.binary

    # ---- lifecycle -----------------------------------------------------------------------------

    def up(self, links: list[Link], echo: Echo = print) -> None:
        """Starts the server unless it runs, then (re)creates every link with the WAN's toxics."""
        if self.pid() is None:
            binary = self.install(echo)
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "toxiproxy.log", "ab") as out:
                proc = subprocess.Popen([str(binary), "-host", "127.0.0.1", "-port", str(self.s.api_port), "-proxy-metrics"],
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            self.pid_file.write_text(str(proc.pid))
            deadline = time.monotonic() + 20.0
            while not self._answers():
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.down(echo=lambda *_: None)
                    raise WanError(f"Toxiproxy did not start on port {self.s.api_port} (taken? choose wan.api_port=N); "
                                   f"log: {self.root / 'toxiproxy.log'}")
                time.sleep(0.2)
            echo(f"Toxiproxy {self.s.version} listening for its API on {self.api} (pid {proc.pid})")
        for link in links:
            self.add(link)
            echo(f"WAN link {link.name}: 127.0.0.1:{link.listen} -> 127.0.0.1:{link.upstream}, "
                 f"{2 * self.s.latency_ms} ms RTT, {self.s.rate_kb_s} KB/s each way")

    def add(self, link: Link) -> None:
        """(Re)creates one proxy with latency and bandwidth toxics in both directions."""
        with contextlib.suppress(WanError):  # not there yet
            self._call("DELETE", f"/proxies/{link.name}")
        self._call("POST", "/proxies", {"name": link.name, "listen": f"127.0.0.1:{link.listen}",
                                        "upstream": f"127.0.0.1:{link.upstream}", "enabled": True})
        for stream in ("upstream", "downstream"):
            self._call("POST", f"/proxies/{link.name}/toxics",
                       {"name": f"latency_{stream}", "type": "latency", "stream": stream, "toxicity": 1.0,
                        "attributes": {"latency": self.s.latency_ms, "jitter": self.s.jitter_ms}})
            self._call("POST", f"/proxies/{link.name}/toxics",
                       {"name": f"bandwidth_{stream}", "type": "bandwidth", "stream": stream, "toxicity": 1.0,
                        "attributes": {"rate": self.s.rate_kb_s}})

    def down(self, echo: Echo = print) -> bool:
        pid = self.pid()
        self.pid_file.unlink(missing_ok=True)
        if pid is None:
            echo("No Toxiproxy is running from this data directory")
            return False
        stop_pid(pid, 10.0)
        echo(f"Toxiproxy (pid {pid}) stopped")
        return True

    def pid(self) -> int | None:
        """The server's pid when its pid file names a live Toxiproxy process."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return pid if b"toxiproxy-server" in cmdline and alive(pid) else None

    def links(self) -> dict[str, Any]:
        """The proxies as the server reports them (name -> {listen, upstream, toxics, ...})."""
        proxies = self._call("GET", "/proxies")
        for name, p in proxies.items():
            p["toxics"] = self._call("GET", f"/proxies/{name}/toxics")
        return proxies

    def bytes(self) -> dict[str, dict[str, int]]:
        """Bytes the server has forwarded per proxy and direction since it started:
        {proxy: {"upstream": to Kafka, "downstream": to region B}}."""
        with urllib.request.urlopen(f"{self.api}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, dict[str, int]] = {}
        for m in re.finditer(r'^toxiproxy_proxy_sent_bytes_total\{([^}]*)\}\s+(\S+)$', text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            per = out.setdefault(labels.get("proxy", "?"), {"upstream": 0, "downstream": 0})
            direction = labels.get("direction", "")
            if direction in per:
                per[direction] += int(float(m.group(2)))
        return out

    # ---- HTTP ----------------------------------------------------------------------------------

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api}/version", timeout=1):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.api}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise WanError(f"Toxiproxy {method} {path} answered {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise WanError(f"Toxiproxy's API at {self.api} does not answer ({exc}); start it with `astraflow wan up`") from exc
        return json.loads(raw) if raw.strip() else None

