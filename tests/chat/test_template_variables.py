"""Extra chat-template variables (``template_kwargs``: Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``):
a template that reads one renders it, one that does not renders as without it, and reserved names are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.chat.template import RESERVED_TEMPLATE_VARIABLES, check_template_kwargs
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import TemplateError

ASK = [{"role": "user", "content": "Say hello."}]
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_a_template_that_reads_a_variable_renders_it(byte_bpe_dir: Path) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(byte_bpe_dir, chat_template=THINKING)
    plain = tokenizer.decode(tokenizer.render_chat(ASK))
    off = tokenizer.decode(tokenizer.render_chat(ASK, template_kwargs={"enable_thinking": False}))
    assert off == plain + "<think>\n\n</think>\n\n"
    assert tokenizer.render_chat(ASK, template_kwargs={"enable_thinking": True}) == tokenizer.render_chat(ASK)


def test_qwen25s_template_ignores_variables_it_does_not_read(qwen_dir: Path) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    qwen = HFTokenizer(qwen_dir)
    variables = {"enable_thinking": False, "reasoning_effort": "high"}
    assert qwen.render_chat(ASK, template_kwargs=variables) == qwen.render_chat(ASK)


def test_the_chatml_template_reads_no_variables() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.render_chat(ASK, template_kwargs={"enable_thinking": False}) == tokenizer.render_chat(ASK)


@pytest.mark.parametrize("name", sorted(RESERVED_TEMPLATE_VARIABLES))
def test_a_reserved_name_is_refused(name: str) -> None:
    with pytest.raises(TemplateError, match=name):
        ByteTokenizer().render_chat(ASK, template_kwargs={name: 1})


@pytest.mark.parametrize("bad", [["enable_thinking"], {"": 1}, {3: True}])
def test_variables_must_be_an_object_of_names(bad) -> None:
    with pytest.raises(TemplateError):
        check_template_kwargs(bad)
