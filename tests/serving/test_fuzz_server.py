"""schemathesis drives the running server from its own OpenAPI schema, with every one of its checks.

`schemathesis run` (the command-line tool, as a third party would run it) against a live server:
every phase but the stateful one, all checks (no server error; status codes, content types,
headers and response bodies as documented; schema-invalid requests refused, schema-valid ones
accepted; response time) plus `semantic_refusals_only` from `schemathesis_hooks.py`. The server
runs a tiny random-weight model over the bundled tokenizer (the serving path is under test, not
the model) with a 64-token context, so no request runs long. Afterwards the server still gives
the same greedy answer and holds no KV block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llm_runtime import EngineConfig, LLMEngine
from llm_runtime.serving.server import create_app
from servers import running, wait_idle

MODEL_NAME = "tiny"
MAX_EXAMPLES = 40
# A schema-valid request may still be refused with 400 (see schemathesis_hooks.py for which ones).
CONFIG = """
[output.sanitization]
enabled = false

[[operations]]
include-name = "POST /v1/completions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "5xx"]

[[operations]]
include-name = "POST /v1/chat/completions"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "5xx"]

# The live feed never ends by itself: each event's schema is checked on the hello and the first state.
[[operations]]
include-name = "GET /v1/engine/events"
max-stream-events = 2
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzzed_server(tiny_chat_model):
    model, tokenizer = tiny_chat_model
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64))
    with running(create_app(engine, MODEL_NAME)) as base:
        yield base, engine


def test_schemathesis_run_passes_every_check_and_the_server_is_unharmed(fuzzed_server, tmp_path: Path) -> None:
    base, engine = fuzzed_server
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    greedy = httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"]
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    here = Path(__file__).parent
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    command = [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "run",
               f"{base}/openapi.json", "--checks", "all", "--mode", "all", "--phases", "examples,coverage,fuzzing",
               "--max-examples", str(MAX_EXAMPLES), "--seed", "0", "--max-response-time", "20", "--no-color"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    generated = re.search(r"(\d+) generated", result.stdout)
    assert generated and int(generated.group(1)) >= 300, result.stdout[-2000:]  # the run really ran
    assert httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"] == greedy
    wait_idle(engine)
    assert engine.stats().num_used_blocks == 0 and httpx.get(f"{base}/health").status_code == 200
