"""Chat templates and tokenizers: a template renders exactly as transformers renders it, or fails as a
ValueError naming the tokenizer; a template that fails, never ends, or renders more than any context
holds is stopped within a bound on time and memory, before anything is tokenized or decoded; a
tokenizer that panics, and prompt text that is not Unicode or too long for any tokenization, are named."""

from __future__ import annotations

import re

import pytest

import jaxsr
from jaxsr import chat_template, text
from jaxsr.loading.embedded import smollm2_draft_path

# -- rendered exactly as transformers renders them -------------------------------------------------


LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)


GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = "
    "'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}"
)


MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
    "message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + "
    "eos_token}}{% else %}{{ '<<SYS>>' ~ message['content'] ~ '<</SYS>>' }}{% endif %}{% endfor %}"
)


QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


FILTERS = (  # the filters, globals and operators templates use, each within the budget
    "{% set ns = namespace(n=0, parts=[]) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}"
    "{% set ns.parts = ns.parts + [m.role|upper] %}{% endfor %}{{ ns.n }} {{ ns.parts|join(', ') }}\n"
    "{{ messages|tojson(indent=2) }}{{ messages[0]|tojson }}{{ dict(a=1, b=[2])|tojson(sort_keys=True) }}\n"
    "{{ '{:>6}|{}'.format('ab', 7) }} {{ '%5s|%-4d' % ('x', 3) }} {{ 'hi'|center(9) }}{{ 'a\\nb'|indent(3) }}"
    "{{ 'x' * 3 ~ '-' * 2 }} {{ 2 ** 10 }} {{ 'a b c d'|wordwrap(3) }} {{ 'abcabc'|replace('b', 'BB') }}"
    "{{ [1, 2, 3]|map('string')|join }} {{ [[1], [2]]|sum(start=[]) }} {{ range(5)|batch(2)|list }}"
    "{{ bos_token ~ eos_token }}{{ strftime_now('%Y') }}{{ messages|selectattr('role', 'eq', 'user')|list }}"
    "{% macro turn(m) %}[{{ m.role }}]{{ caller() }}{% endmacro %}{% for m in messages %}{% call turn(m) %}"
    "{{ m.content|truncate(9) }}{% endcall %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{% set block %}{{ messages|length }} turns{% endset %}{{ block|title }}{{ 'ab'.zfill(5) }}"
)


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 × 3 — ünïcode?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers():
    """Every tokenizer with a chat template available offline: SmolLM2's (the shipped draft, the GGUF's
    tokenizer is the same template) and the byte-level test tokenizer's ChatML."""
    import hf_fixtures as H
    from transformers import AutoTokenizer

    from jaxsr.loading.embedded import smollm2_draft_path

    return {"smollm2": AutoTokenizer.from_pretrained(str(smollm2_draft_path())), "bytes": H.byte_tokenizer()}


@pytest.fixture
def tokenizer(tokenizers):
    """SmolLM2's tokenizer (of `tokenizers`), its chat template as shipped again after the test."""
    tokenizer = tokenizers["smollm2"]
    original = tokenizer.chat_template
    yield tokenizer
    tokenizer.chat_template = original


@pytest.mark.parametrize("template", [None, LLAMA3, GEMMA, MISTRAL, QWEN, FILTERS])
@pytest.mark.parametrize("prompt", [True, False])
def test_chat_templates_render_exactly_as_transformers_renders_them(tokenizers, template, prompt):
    """Or fail where transformers fails (the byte tokenizer has no bos_token), as a ValueError."""
    from jaxsr import text

    for tokenizer in tokenizers.values():
        original = tokenizer.chat_template
        tokenizer.chat_template = template or original
        try:
            for messages in CONVERSATIONS:
                try:
                    expected = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=prompt
                    )
                except Exception as e:
                    with pytest.raises(ValueError, match=f"chat template of .*{type(e).__name__}: {e}"):
                        text.render_chat(tokenizer, messages, add_generation_prompt=prompt)
                    continue
                assert text.render_chat(tokenizer, messages, add_generation_prompt=prompt) == expected
        finally:
            tokenizer.chat_template = original


def test_the_shipped_template_renders_within_the_budget_and_tracing_is_restored(tokenizer):
    import sys

    before = sys.gettrace()
    rendered = text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert sys.gettrace() is before


# -- templates that fail, never end or render too much ---------------------------------------------


ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{{ raise_exception('only user turns') }}", "only user turns"),
        ("{% for m in messages %}{{ m.content.nope() }}{% endfor %}", "UndefinedError"),
        ("{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}", "SecurityError"),
    ],
    ids=["raises", "undefined", "sandbox"],
)
def test_a_failing_chat_template_is_a_value_error_naming_the_tokenizer(tokenizer, template, named):
    tokenizer.chat_template = template
    with pytest.raises(ValueError, match="chat template of") as info:
        text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert named in str(info.value)


def test_a_chat_template_that_never_ends_is_stopped(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_template, "LINE_BUDGET", 20_000)
    tokenizer.chat_template = ENDLESS
    with pytest.raises(ValueError, match="still rendering after 20000 template lines"):
        text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


RUNAWAYS = [
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**10 }}",
    "{{ 2 ** 10000000000 }}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s=['a']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ range(100000)|join('x' * 100000) }}",
    "{{ 'x'.join(['y' * 100000] * 100000) }}",
    "{{ 'a'|center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ 'a'.zfill(10**10) }}",
    "{{ '%0999999999999d' % 1 }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ '%09999999999d'|format(1) }}",
    "{{ '{:>9999999999}'.format(1) }}",
    "{{ '{:>{}}'.format(1, 10**10) }}",
    "{{ '{a:>9999999999}'.format_map({'a': 1}) }}",
    "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "{{ 'x\\ny'|indent(10**10) }}",
    "{{ 'a b'|wordwrap(1, wrapstring='x' * 1000000) }}",
    "{{ [1]|batch(10**10, 0)|list }}",
    "{{ [1]|slice(10**10)|list }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ dict.fromkeys(range(100000), 'x' * 100000)|tojson }}",
    "{{ ([['a'] * 100000] * 100000)|sum(start=[]) }}",
    "{{ ['a' * 100000] * 100000 }}",
    "{{ (['a' * 100000] * 100000)|string }}",
    "{{ ['a' * 100000] * 100000 ~ '' }}",
    "{{ range(100000)|map('center', 100000)|join }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "{% set x %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}{{ x }}",
    "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", RUNAWAYS)
def test_a_runaway_template_is_refused_quickly_naming_the_tokenizer(tokenizers, template):
    import resource
    import time

    from jaxsr import chat_template, text

    tokenizer = tokenizers["smollm2"]
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    started, peak = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with pytest.raises(
            ValueError, match=f"^chat template of {re.escape(tokenizer.name_or_path)}: "
        ) as error:
            text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    finally:
        tokenizer.chat_template = original
    assert isinstance(error.value.__context__, chat_template.TemplateOverBudget | OverflowError | None)
    assert time.perf_counter() - started < 6  # (~2 s at most on a loaded CPU: loops of 100 000 turns)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20  # KiB: under 1 GiB more


def test_generate_refuses_a_runaway_template_before_decoding(monkeypatch):
    model = jaxsr.load_model(smollm2_draft_path())
    monkeypatch.setattr(chat_template, "LINE_BUDGET", 20_000)
    model.tokenizer.chat_template = ENDLESS
    with pytest.raises(ValueError, match="chat template"):
        jaxsr.generate(model, ["hi"], max_new_tokens=2)


def test_a_template_that_renders_gigabytes_is_refused_before_tokenizing(monkeypatch):
    """A one-line template can turn "hi" into more text than any context holds: refused by its length
    before the tokenizer (whose allocation failure would abort the process) sees it."""
    model = jaxsr.load_model(smollm2_draft_path())
    model.tokenizer.chat_template = "{{ 'x' * 10**7 }}"
    encode = text.encode

    def short_only(tokenizer, rendered, **kwargs):
        assert len(rendered) < 10**6, "the rendering was tokenized"
        return encode(tokenizer, rendered, **kwargs)

    monkeypatch.setattr(text, "encode", short_only)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: chat template of .*10{7}"):
        jaxsr.generate(model, ["hi"], max_new_tokens=2)


# -- tokenizers and prompt text --------------------------------------------------------------------


def test_a_tokenizer_that_panics_is_a_value_error_naming_it():
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from jaxsr import text

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("((a+)+)+b"), behavior="isolated")  # backtracks
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(ValueError, match=r"tokenizer of .* failed on a text: .*retry-limit"):
        text.encode(tokenizer, "a" * 30)
    assert text.encode(tokenizer, "a") == [1]  # the same tokenizer on a text it can take


def test_text_that_is_not_unicode_is_named():
    model = jaxsr.load_model(smollm2_draft_path())
    with pytest.raises(ValueError, match=r"^prompts\[1\]: not valid Unicode"):
        jaxsr.generate(model, ["fine", "\ud800 hi"], max_new_tokens=2)


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(monkeypatch):
    """30 MB of text would take gigabytes to tokenize only to be refused for its length."""
    model = jaxsr.load_model(smollm2_draft_path())

    encode = jaxsr.text.encode

    def short_only(tokenizer, text, **kwargs):
        assert len(text) < 1000, "the long text was tokenized"
        return encode(tokenizer, text, **kwargs)

    monkeypatch.setattr(jaxsr.text, "encode", short_only)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: 30000000 characters cannot fit .* context of"):
        jaxsr.generate(model, ["fine", "x" * 30_000_000], max_new_tokens=2)
