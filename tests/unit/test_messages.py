"""normalize_messages: which turns may omit `content` (OpenAI: only an assistant turn)."""
from __future__ import annotations

import pytest

from radixserve.errors import InvalidRequest
from radixserve.tokenizer.messages import normalize_messages


@pytest.mark.parametrize("role", ["user", "system", "tool", "developer"])
@pytest.mark.parametrize("content", ["absent", None])
def test_a_turn_without_content_is_refused(role, content):
    msg = {"role": role} if content == "absent" else {"role": role, "content": content}
    with pytest.raises(InvalidRequest, match=r"messages\[1\]\.content is required") as err:
        normalize_messages([{"role": "user", "content": "hi"}, msg])
    assert err.value.param == "messages"


def test_an_assistant_turn_may_omit_content():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    out = normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                              {"role": "assistant", "content": None}])
    assert [m["content"] for m in out] == ["hi", "", ""]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
