"""Chat templates are untrusted code (issue 34): each way a template could hang the process,
allocate without bound or raise a non-mlxr error is a TokenizerError naming the limit, quickly.
(Real templates still render byte-identical to transformers: tests/test_chat.py.)"""

from __future__ import annotations

import dataclasses
import time

import pytest

from mlxr.text import template_sandbox
from mlxr.text.chat import render_chat_template
from mlxr.errors import TokenizerError

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "range(10**9)": ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    "recursive macro": ("{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    "[0]*10**9": ("{{ ([0]*10**9)|length }}", "repeating a list"),
    "'x'*300000000": ("{{ 'x'*300000000 }}", "repeating a str"),
    "big power": ("{{ 7**123456789 }}", "integer power"),
    "big product": ("{% set ns = namespace(x=2) %}{% for i in range(40) %}"
                    "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}", "integer product"),
    "lipsum(n=200000)": ("{{ lipsum(n=200000) }}", "lipsum"),
    "tojson(indent=10**9)": ("{{ messages|tojson(indent=10**9) }}", "tojson indent"),
    "strftime_now('%Y'*10**6)": ("{{ strftime_now('%Y'*10**6) }}", "strftime_now"),
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "modulo by zero": ("{{ 1 % 0 }}", "ZeroDivisionError"),
    "lone surrogate": ("{{ '\\ud800' }}", "surrogate"),
    "'%1000000000s'": ("{{ '%1000000000s' % 'x' }}", "width"),
    "center(10**9)": ("{{ 'x'|center(10**9) }}", "center"),
    "ljust(10**9)": ("{{ 'x'.ljust(10**9) }}", "ljust"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", "str.format"),
    "batch(10**9)": ("{{ [1]|batch(10**9, 'x')|list|length }}", "batch"),
    "slice(10**8)": ("{{ [1, 2]|slice(10**8)|list|length }}", "slice"),
    "indent(10**9)": ("{{ 'a\nb'|indent(10**9) }}", "indent"),
    "replace('', s)": ("{% set s = 'x'*100000 %}{{ s.replace('', s)|length }}", "replace"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                 "{% set ns.s = ns.s + ns.s %}{% endfor %}", "concatenation"),
    "output size": ("{% set s = 'x'*10000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
                    "output size"),
    "captured block": ("{% set s = 'x'*10000000 %}{% for i in range(100) %}{% set b %}"
                       "{{ s }}{% endset %}{% endfor %}", "output size"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_template_is_a_clear_error(case):
    source, needle = HOSTILE[case]
    start = time.monotonic()
    with pytest.raises(TokenizerError) as e:
        render_chat_template(source, MESSAGES)
    assert needle in str(e.value), str(e.value)
    assert time.monotonic() - start < 3.0


def test_render_time_is_bounded(monkeypatch):
    limits = dataclasses.replace(template_sandbox.DEFAULT_LIMITS, max_seconds=0.3)
    monkeypatch.setattr(template_sandbox, "DEFAULT_LIMITS", limits)
    start = time.monotonic()
    with pytest.raises(TokenizerError, match="render time"):
        render_chat_template("{% for i in range(100000) %}{% for j in range(3000) %}"
                             "{% endfor %}{% endfor %}", MESSAGES)
    assert time.monotonic() - start < 2.0


def test_limits_leave_ordinary_templates_alone():
    out = render_chat_template(
        "{{ 'ab'|center(6) }}|{{ [1, 2, 3]|slice(2)|list }}|{{ 'a b'|replace(' ', '_') }}|"
        "{{ '%5.2f' % 3.14159 }}|{{ '{:>4}'.format(7) }}|{{ 2**10 }}|{{ 'x' * 3 }}|"
        "{{ messages|tojson(indent=2)|length > 0 }}", MESSAGES)
    assert out == "  ab  |[[1, 2], [3]]|a_b| 3.14|   7|1024|xxx|True"
