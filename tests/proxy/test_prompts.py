"""One prompt per P/D request: a batch is refused before any backend sees it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.proxy.rig import Rig, completion


@pytest.mark.parametrize("prompt", [["one", "two"], [[1, 2], [3]]])
def test_a_batch_of_prompts_is_a_400_naming_prompt_and_reaches_no_backend(
    make_rig: Callable[..., Rig], prompt: list
) -> None:
    """A vLLM prefill would hold the KV of every prompt and answer with one's params: the other
    holds would pin the prefill's blocks until their lease ends."""
    rig = make_rig()
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(prompt), headers={"X-Request-Id": "b1"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "prompt" and f"{len(prompt)} prompts" in error["message"]
    assert resp.headers["x-request-id"] == "b1"
    assert rig.prefills[0].seen == [] and rig.decodes[0].seen == []


@pytest.mark.parametrize("prompt", ["one", ["one"], [1, 2, 3], [[1, 2, 3]]])
def test_one_prompt_in_any_of_its_shapes_goes_through(
    make_rig: Callable[..., Rig], prompt: object
) -> None:
    rig = make_rig()
    with rig.client() as c:
        assert c.post("/v1/completions", json=completion(prompt)).status_code == 200  # type: ignore[arg-type]
    assert rig.prefills[0].seen[0].body["prompt"] == prompt
