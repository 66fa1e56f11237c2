"""The CLI answers --help instantly: no torch, transformers or faust import."""

import subprocess
import sys


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from astraflow_cli.main import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "for sub in ['kafka', 'topics', 'raas', 'train', 'demo', 'model']:\n"
        "    assert CliRunner().invoke(app, [sub, '--help']).exit_code == 0, sub\n"
        "heavy = [m for m in ('torch', 'transformers', 'faust', 'lightning') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_config_errors_are_one_readable_line() -> None:
    res = subprocess.run([sys.executable, "-m", "astraflow_cli.main", "--set", "topics.partitions=x", "config"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and "topics.partitions" in res.stderr and "Traceback" not in res.stderr
    assert "ConfigError" not in res.stderr  # what is wrong, not the name of an internal exception
