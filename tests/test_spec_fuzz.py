"""Random spec strings and values: a compressor or a ValueError/TypeError, nothing else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.spec import REGISTRY

KEYS = ["ratio", "seed", "lam", "budget", "rank", "power_iterations", "min_compression_rate",
        "warm_start", "levels", "bucket_size", "k", "x"]
VALUES = st.one_of(
    st.integers(-5, 300).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "nan", "inf", "-inf", "abc", "", "1e-3", "0.5", "1,2"]),
)


@st.composite
def specs(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from([*REGISTRY, "topk ", "Topk", "zip", ""]))
    pairs = draw(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=3))
    sep = draw(st.sampled_from([":", ": ", "::", ""]))
    body = ",".join(f"{k}={v}" for k, v in pairs)
    return name + (sep + body if pairs or sep else "")


@settings(max_examples=200, deadline=None)
@given(spec=st.one_of(specs(), st.text(max_size=30)))
def test_any_spec_string_builds_or_fails_cleanly(spec: str) -> None:
    try:
        comp = gradzip.compressor_from_spec(spec)
    except (ValueError, TypeError) as err:
        message = str(err)
        assert message and "\n" not in message
        assert "`" in message  # names the parameter (or the spec) it is about
    else:
        assert isinstance(comp, gradzip.Compressor)
        assert gradzip.compressor_from_spec(comp.spec()) == comp
