"""Lesson 18's helpers (lessons/disaggregation.py): the client counts one token per streamed chunk (not a chat
stream's role chunk) and takes non-streamed answers whole; a server process that cannot start says why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
from servers import bundled_server  # noqa: E402

from llm_runtime.lessons.disaggregation import ServerProcess, counters, stream_requests  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_client_times_every_token(bundled) -> None:
    with bundled_server(bundled) as (base, _, _):
        chat = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 5, "ignore_eos": True,
                "temperature": 0}
        streamed, whole = stream_requests(base, [chat, {**chat, "stream": False}], [0.0, 0.2],
                                          path="/v1/chat/completions")
        assert streamed.status == 200 and streamed.timing is not None
        assert streamed.timing.num_output_tokens == 5 and streamed.timing.num_prompt_tokens > 0
        assert streamed.timing.ttft > 0 and len(streamed.timing.itls) == 4
        assert whole.status == 200 and whole.timing is None and whole.text == streamed.text
        completion = stream_requests(base, [{"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}])[0]
        assert completion.timing.num_output_tokens == 3 and completion.timing.num_prompt_tokens == 3
        refused = stream_requests(base, [{"prompt": "x", "max_tokens": -1}])[0]
        assert refused.status == 400 and refused.timing is None and "max_tokens" in refused.error
        assert counters(base)["num_requests_running"] == 0


def test_a_server_that_cannot_start_says_why() -> None:
    with pytest.raises(RuntimeError, match="serve exited with code 2: error: quantized layers compute in"):
        ServerProcess.serve(["--quantization", "gguf", "--dtype", "float16", "--device", "cpu"], timeout_s=120)
    with pytest.raises(ValueError, match="kind"):
        ServerProcess.start("bench")
