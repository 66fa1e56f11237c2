"""The compose stack validates without a Docker engine: structure, and every command it runs.

This checks, in a second and without an engine, what `docker compose config` would, following
the compose specification (tests/docker/test_compose_stack.py starts the stack for real): known keys, dependencies that exist with valid
conditions (healthy ones on services that have a health check, completed ones on one-shot
jobs), declared named volumes, existing bind-mount sources and Dockerfiles, profiles, and
variables that all have defaults. Then it parses every `astraflow ...` command line of the stack
(entrypoint + command, health checks, the init script) with the real CLI, so an option that does
not exist or a missing required one fails here instead of in a container.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml
from cli_parse import parse_cli
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"

# Top-level and service keys of the compose specification (compose-spec/schema/compose-spec.json).
TOP_KEYS = {"version", "name", "include", "services", "models", "networks", "volumes", "secrets", "configs"}
SERVICE_KEYS = {
    "develop", "deploy", "annotations", "attach", "build", "blkio_config", "cap_add", "cap_drop", "cgroup",
    "cgroup_parent", "command", "configs", "container_name", "cpu_count", "cpu_percent", "cpu_shares", "cpu_quota",
    "cpu_period", "cpu_rt_period", "cpu_rt_runtime", "cpus", "cpuset", "credential_spec", "depends_on",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "label_file", "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add",
    "healthcheck", "hostname", "image", "init", "ipc", "isolation", "labels", "links", "logging", "mac_address",
    "mem_limit", "mem_reservation", "mem_swappiness", "memswap_limit", "models", "network_mode", "networks",
    "oom_kill_disable", "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop",
    "privileged", "profiles", "provider", "pull_policy", "pull_refresh_after", "read_only", "restart", "runtime",
    "scale", "secrets", "security_opt", "shm_size", "stdin_open", "stop_grace_period", "stop_signal",
    "storage_opt", "sysctls", "tmpfs", "tty", "ulimits", "use_api_socket", "user", "userns_mode", "uts",
    "volumes", "volumes_from", "working_dir",
}
HEALTHCHECK_KEYS = {"disable", "interval", "retries", "test", "timeout", "start_period", "start_interval"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
DURATION = re.compile(r"^(\d+(\.\d+)?(us|ms|s|m|h))+$")
RESTART = re.compile(r"^(no|always|unless-stopped|on-failure(:\d+)?)$")
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$`, applied to every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if op in (":-", "-"):
            return env.get(name) or arg if op == ":-" else env.get(name, arg)
        if op in (":?", "?") and name not in env:
            raise AssertionError(f"variable {name} is required: {arg}")
        return env.get(name, "")

    return VAR.sub(sub, value).replace("$$", "$")


def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose() -> dict[str, Any]:
    """The compose file as `docker compose config` would resolve it with an empty environment."""
    return interpolate(raw(), {})


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def argv_of(service: dict[str, Any]) -> list[str]:
    entry = service.get("entrypoint") or []
    command = service.get("command") or []
    entry = shlex.split(entry) if isinstance(entry, str) else list(entry)
    command = shlex.split(command) if isinstance(command, str) else list(command)
    return entry + command


def astraflow_lines() -> list[tuple[str, list[str]]]:
    """(where, argv after `astraflow`) for every astraflow invocation the stack makes."""
    out: list[tuple[str, list[str]]] = []
    for name, svc in services().items():
        argv = argv_of(svc)
        if argv[:1] == ["astraflow"]:
            out.append((f"{name}", argv[1:]))
        elif argv[:2] == ["sh", "-c"]:
            for i, line in enumerate(shell_commands(" ".join(argv[2:]))):
                if line[:1] == ["astraflow"]:
                    out.append((f"{name}:sh[{i}]", line[1:]))
        test = (svc.get("healthcheck") or {}).get("test") or []
        if test[:2] == ["CMD", "astraflow"]:
            out.append((f"{name}:healthcheck", test[2:]))
    return out


def shell_commands(script: str) -> list[list[str]]:
    """Simple commands of a shell script (split on ; && || { } and newlines)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|{}")
    lexer.whitespace_split = True
    out, cur = [], []
    for tok in lexer:
        if tok in {";", "&&", "||", "{", "}", "&", "|"} or set(tok) <= set(";&|{}"):
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(tok)
    if cur:
        out.append(cur)
    return out


# --- structure ----------------------------------------------------------------------------------


def test_top_level_and_service_keys_are_compose_spec_keys() -> None:
    doc = raw()
    assert set(k for k in doc if not k.startswith("x-")) <= TOP_KEYS
    for name, svc in doc["services"].items():
        assert re.fullmatch(r"[a-zA-Z0-9._-]+", name)
        unknown = set(svc) - SERVICE_KEYS
        assert not unknown, f"service {name}: keys not in the compose spec: {unknown}"
        assert "image" in svc or "build" in svc, f"service {name} has neither image nor build"
        if "restart" in svc:
            assert RESTART.match(str(svc["restart"])), f"{name}: restart {svc['restart']!r}"
        for key in ("command", "entrypoint"):
            if key in svc:
                assert isinstance(svc[key], str | list), f"{name}.{key}"
                assert all(isinstance(x, str) for x in (svc[key] if isinstance(svc[key], list) else [svc[key]])), \
                    f"{name}.{key}: every argument must be a string (quote numbers)"


def test_every_variable_has_a_default() -> None:
    """`docker compose config` must work with no .env file."""
    text = COMPOSE.read_text()
    for m in VAR.finditer(text):
        assert m.group(2) in (":-", "-"), f"${{{m.group(1)}}} has no default"
    stripped = VAR.sub("", text).replace("$$", "")
    assert "$" not in stripped, "use ${VAR:-default} (or $$ for a literal $)"


def test_dependencies_exist_with_valid_conditions_and_no_cycle() -> None:
    svcs = services()
    graph: dict[str, set[str]] = {}
    for name, svc in svcs.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        graph[name] = set(deps)
        for dep, spec in deps.items():
            assert dep in svcs, f"{name} depends on unknown service {dep}"
            cond = spec.get("condition")
            assert cond in CONDITIONS, f"{name} -> {dep}: condition {cond!r}"
            target = svcs[dep]
            if cond == "service_healthy":
                hc = target.get("healthcheck") or {}
                assert hc.get("test") and not hc.get("disable"), f"{name} waits for {dep} to be healthy, but it has no health check"
            if cond == "service_completed_successfully":
                assert str(target.get("restart", "no")) == "no", f"{dep} is waited for to complete, so it must not restart"
            # A service that always runs cannot wait for one that only runs in a profile.
            if not svc.get("profiles"):
                assert not target.get("profiles"), f"{name} (no profile) depends on {dep} (profiles {target['profiles']})"

    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        assert state.get(n) != 1, f"dependency cycle: {' -> '.join([*path, n])}"
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in graph[n]:
            visit(d, [*path, n])
        state[n] = 2

    for n in graph:
        visit(n, [])


def test_health_checks() -> None:
    svcs = services()
    assert svcs["kafka"]["healthcheck"]["test"], "kafka needs a health check: everything waits on it"
    for name, svc in svcs.items():
        hc = svc.get("healthcheck")
        if not hc:
            continue
        assert set(hc) <= HEALTHCHECK_KEYS, f"{name}: {set(hc) - HEALTHCHECK_KEYS}"
        if hc.get("disable"):
            continue
        assert hc["test"][0] in ("CMD", "CMD-SHELL", "NONE"), f"{name}: healthcheck test must start with CMD or CMD-SHELL"
        for key in ("interval", "timeout", "start_period", "start_interval"):
            if key in hc:
                assert DURATION.match(str(hc[key])), f"{name}.healthcheck.{key}={hc[key]!r}"
    long_running = [n for n, s in svcs.items() if str(s.get("restart", "no")) != "no"]
    for name in long_running:
        hc = svcs[name].get("healthcheck") or {}
        assert hc.get("test") and not hc.get("disable"), f"long-running service {name} has no health check"


def test_volumes_are_declared_and_bind_mounts_exist() -> None:
    doc = compose()
    declared = set(doc.get("volumes") or {})
    used: set[str] = set()
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes") or []:
            source = vol["source"] if isinstance(vol, dict) else vol.split(":")[0]
            if source.startswith((".", "/", "~")):
                assert (DOCKER / source).resolve().exists(), f"{name}: bind-mount source {source} does not exist"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared under volumes:"
                used.add(source)
    assert declared == used, f"declared but unused volumes: {declared - used}"
    for needed in ("kafka-data", "models", "checkpoints", "weights", "archives"):
        assert needed in declared


def test_builds_use_the_dockerfiles_of_this_repo() -> None:
    own_contexts = {"kafka": DOCKER / "kafka", "prometheus": DOCKER / "prometheus"}
    for name, svc in services().items():
        build = svc.get("build")
        if build is None:
            continue
        ctx = (DOCKER / build["context"]).resolve()
        dockerfile = ctx / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        text = dockerfile.read_text()
        # Every image takes its base as a build argument (a local one where no registry answers).
        assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M), \
            f"{dockerfile}: FROM ${{BASE_IMAGE}} with a default"
        assert build.get("args", {}).get("BASE_IMAGE"), f"{name}: pass BASE_IMAGE (AF_BASE_IMAGE)"
        if name in own_contexts:
            assert ctx == own_contexts[name].resolve(), f"{name}: build context must be {own_contexts[name]}"
            continue
        assert ctx == ROOT, f"{name}: build context must be the repository root"
        assert re.search(r'^ENTRYPOINT \["astraflow"\]', text, re.M), f"{dockerfile.name}: entrypoint must be astraflow"
    cpu = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim", cpu, re.M)
    assert "--mount=type=cache,target=/var/cache/astraflow-wheels" in cpu, "wheels must stay in the build cache"
    assert "vllm" in (DOCKER / "Dockerfile.gpu").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (DOCKER / name).read_text()
        for folder in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
            for part in folder.split():
                assert (ROOT / part).exists(), f"{name} copies {part}, which the repository lacks"
                assert f"!{part}" in ignored, f".dockerignore leaves {part} out of the build context"
    for sub in ("kafka", "prometheus"):
        text = (DOCKER / sub / "Dockerfile").read_text()
        for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
            assert (DOCKER / sub / src).exists(), f"docker/{sub}/Dockerfile copies {src}, which is missing"


def test_kafka_is_built_from_the_local_kafka_jars() -> None:
    pom = (DOCKER / "kafka" / "pom.xml").read_text()
    version = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", pom).group(1)
    assert version.startswith("4."), "KRaft-only Kafka 4.x"
    kafka = services()["kafka"]
    assert kafka["image"] == f"astraflow/kafka:{version}", "the image is tagged with the pom's Kafka version"
    assert "pom.xml" in (DOCKER / "kafka" / "Dockerfile").read_text(), "the image resolves the pom's jars"
    entry = (DOCKER / "kafka" / "kafka-entrypoint.sh").read_text()
    assert "process.roles=broker,controller" in entry
    data = re.search(r"^DATA=(\S+)", entry, re.M).group(1)
    assert data in [v.split(":")[1] for v in kafka["volumes"]], "the log dir must be the volume"
    assert kafka["environment"]["KAFKA_ADVERTISED"] == "kafka:9092"
    assert kafka["healthcheck"]["test"][-1] == "ready", "health = a metadata request, not an open port"


def test_host_ports_are_loopback_only() -> None:
    for name, svc in services().items():
        for port in svc.get("ports") or []:
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish {port} on 127.0.0.1 only"


def test_prometheus_scrapes_every_role_itself_and_the_bridge() -> None:
    svcs = services()
    prom = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    bridge_target = jobs["kafka"]["static_configs"][0]["targets"][0]
    host, port = bridge_target.split(":")
    assert host in svcs and f"--port {port}" in " ".join(argv_of(svcs[host]))
    dns = jobs["roles"]["dns_sd_configs"][0]
    assert dns["type"] == "A"
    # Every long-running astraflow role (not the bridge, not one-shots) is scraped, on the port it serves.
    roles = {n for n, s in svcs.items() if argv_of(s)[:1] == ["astraflow"] and str(s.get("restart", "no")) != "no"
             and n != host and "status" not in argv_of(s)}
    assert roles == set(dns["names"]), roles ^ set(dns["names"])
    for role in roles:
        env = svcs[role]["environment"]
        assert env["ASTRAFLOW_METRICS_PORT"] == str(dns["port"]) and env["ASTRAFLOW_METRICS_ADDR"] == "0.0.0.0", role
    assert {"source_labels": ["__meta_dns_name"], "target_label": "job"} in jobs["roles"]["relabel_configs"]
    assert any("prometheus.yml" in v for v in svcs["prometheus"]["volumes"])


def test_a_role_whose_process_dies_comes_back() -> None:
    """A crashed role restarts (the docker test kills a node's process); one-shots never do."""
    for name, svc in services().items():
        argv = argv_of(svc)
        if argv[:1] == ["astraflow"] and "status" not in argv and name != "topics":
            assert svc.get("restart") in ("always", "unless-stopped"), name


def test_every_role_stops_gracefully_as_a_child_of_init() -> None:
    for name, svc in services().items():
        argv = argv_of(svc)
        if argv[:1] == ["astraflow"] or argv[:2] == ["sh", "-c"]:
            assert svc.get("init") is True, f"{name}: init: true (Python as PID 1 ignores SIGTERM)"
        if str(svc.get("restart", "no")) != "no":
            assert DURATION.match(str(svc.get("stop_grace_period", ""))), f"{name}: no stop_grace_period"


def test_roles_profiles_and_scaling() -> None:
    svcs = services()
    for role in ("kafka", "topics", "curator", "reward", "curate", "archive", "raas", "trainer", "raas-gpu", "trainer-gpu", "eval"):
        assert role in svcs, f"the stack lacks {role}"
    assert set(svcs["raas"]["profiles"]) == {"cpu"} and set(svcs["trainer"]["profiles"]) == {"cpu"}
    assert set(svcs["raas-gpu"]["profiles"]) == {"gpu"} and set(svcs["trainer-gpu"]["profiles"]) == {"gpu"}
    for name in ("raas", "raas-gpu"):
        assert "container_name" not in svcs[name] and "ports" not in svcs[name], f"{name} must scale with --scale"
    gpu = svcs["raas-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "vllm" in argv_of(svcs["raas-gpu"])
    assert svcs["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_configuration_by_environment_and_one_mounted_file() -> None:
    """Every astraflow role mounts the config file, points at the compose Kafka, and its
    ASTRAFLOW__* variables resolve with the config model of the command it runs."""
    from astraflow.config import load_config
    from trainers.config import TrainRunConfig

    for path in sorted((DOCKER / "config").glob("*.y*ml")):
        load_config(path, env={})
        load_config(path, env={}, model=TrainRunConfig)
    for name, svc in services().items():
        argv = argv_of(svc)
        if argv[:1] != ["astraflow"] and argv[:2] != ["sh", "-c"]:
            continue
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in svc.get("volumes", [])]
        assert "./config/astraflow.yaml:/etc/astraflow/astraflow.yaml:ro" in mounts, f"{name} lacks the config file"
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        assert env.get("ASTRAFLOW__KAFKA__BOOTSTRAP_SERVERS") == "kafka:9092", name
        model = TrainRunConfig if "train" in argv else None
        cfg = load_config(DOCKER / "config" / "astraflow.yaml", env=env, **({"model": model} if model else {}))
        assert cfg.kafka.bootstrap_servers == "kafka:9092"


# --- every command exists in the CLI --------------------------------------------------------------

LINES = astraflow_lines()


# Recent typer vendors its own click: catch its usage errors as well as click's.
USAGE_ERRORS: tuple[type[Exception], ...] = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


@pytest.mark.parametrize(("where", "argv"), LINES, ids=[w for w, _ in LINES])
def test_every_compose_command_exists_in_the_cli(where: str, argv: list[str]) -> None:
    from astraflow_cli.main import app

    try:
        path, _ = parse_cli(argv)
    except USAGE_ERRORS as exc:
        pytest.fail(f"{where}: `astraflow {shlex.join(argv)}` does not parse: {exc.format_message()}")  # type: ignore[attr-defined]
    assert path, f"{where}: no subcommand"
    res = CliRunner().invoke(app, [*path, "--help"])
    assert res.exit_code == 0, f"{where}: astraflow {' '.join(path)} --help failed: {res.output}"


def test_the_stack_runs_astraflow_for_every_role() -> None:
    paths = {w.split(":")[0]: a for w, a in LINES if ":" not in w}
    assert {"topics", "reward", "curate", "curator", "archive", "raas", "trainer", "raas-gpu", "trainer-gpu", "eval",
            "metrics", "status"} <= set(paths)


def test_init_script_python_imports_exist() -> None:
    """The init job's `python -c` imports real names (checked by importing them, not running them)."""
    argv = argv_of(services()["init"])
    code = [c for c in shell_commands(" ".join(argv[2:])) if c[:2] == ["python", "-c"]]
    assert code, "init writes the demo data sets with python -c"
    for tree in (ast.parse(c[2]) for c in code):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_the_schema_registry_is_an_opt_in_profile_whose_image_the_host_builds() -> None:
    """`registry` runs only with its profile, from the image scripts/compose.sh builds out of what
    `astraflow registry bundle` stages; roles use it only when AF_SCHEMA_REGISTRY_URL says so."""
    from astraflow.config import load_config
    from astraflow.registry_image import ARGS, DIST, IMAGE_DATA_DIR, JAVA

    svcs = services()
    reg = svcs["registry"]
    assert reg["profiles"] == ["registry"], "the default stack runs without a registry"
    version = re.search(r"<apicurio\.version>([^<]+)<", (DOCKER / "registry" / "pom.xml").read_text()).group(1)
    assert reg["image"] == f"astraflow/registry:{version}", "the image is tagged with the pom's Apicurio version"
    assert "build" not in reg and reg["pull_policy"] == "never", "its build context is staged on the host"
    assert not any("registry" in (s.get("depends_on") or {}) for n, s in svcs.items() if n != "registry")
    dockerfile = (DOCKER / "registry" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+", dockerfile, re.M) and re.search(r"^FROM \$\{BASE_IMAGE\}", dockerfile, re.M)
    assert sorted(re.findall(r"^COPY (\S+) ", dockerfile, re.M)) == sorted([DIST, JAVA, ARGS]), "what bundle stages"
    assert f"@/opt/apicurio/{ARGS}" in dockerfile, "the image's registry runs with the JVM flags bundle stages"
    assert "-Dquarkus.http.port=8080" in dockerfile and reg["ports"][0].endswith(":8080")
    assert "/apis/ccompat/v7/" in " ".join(reg["healthcheck"]["test"]), "healthy = the API roles use answers"
    assert re.search(r"^VOLUME (\S+)$", dockerfile, re.M).group(1) == IMAGE_DATA_DIR
    assert [v.split(":")[1] for v in reg["volumes"]] == [IMAGE_DATA_DIR], \
        "schema ids must survive a restart: the database in a volume"

    url = "http://registry:8080/apis/ccompat/v7"
    assert f"AF_SCHEMA_REGISTRY_URL=${{AF_SCHEMA_REGISTRY_URL:-{url}}}" in (ROOT / "scripts" / "compose.sh").read_text()
    for env, expected in (({}, None), ({"AF_SCHEMA_REGISTRY_URL": url}, url)):
        role_env = interpolate(raw(), env)["services"]["curate"]["environment"]
        cfg = load_config(DOCKER / "config" / "astraflow.yaml", env={k: str(v) for k, v in role_env.items()})
        assert cfg.kafka.schema_registry_url == expected


def test_the_registry_image_needs_a_jdk_with_jlink(tmp_path: Path) -> None:
    from astraflow.errors import ToolMissingError
    from astraflow.registry_image import jdk_of

    jre = tmp_path / "jre"
    (jre / "bin").mkdir(parents=True)
    (jre / "bin" / "java").touch()
    with pytest.raises(ToolMissingError, match="needs a JDK 21"):
        jdk_of(str(jre / "bin" / "java"))
    (jre / "bin" / "jlink").touch()
    assert jdk_of(str(jre / "bin" / "java")) == jre.resolve()
