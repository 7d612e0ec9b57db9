"""The doctor: the capability table against the installed onnxruntime, on this CPU machine."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from onnx_kvcache.capabilities.table import CAPABILITIES, FormatSupport
from onnx_kvcache.cli.commands import main
from onnx_kvcache.errors import KvCacheError
from onnx_kvcache.runtime import doctor

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def report():
    return doctor.run_doctor(["CPUExecutionProvider"])


def test_schemas_agree_with_the_operator_rows(report):
    checks = {s.op: s for s in report.schemas}
    assert set(checks) == {"GroupQueryAttention", "PagedAttention"}
    assert all(s.agrees for s in checks.values()), [s.problems for s in checks.values()]
    paged = " ".join(checks["PagedAttention"].facts)
    assert "scales at inputs 14/15" in paged and "k_cache_dtype" in paged and "no kv_cache_bit_width" in paged
    assert "LATENT" in paged and "query T admits bfloat16, float16" in paged


def test_cpu_rows_are_proven_by_sessions(report):
    rows = {(r.op, r.provider, r.cache): r for r in report.rows}
    for g in ("per_tensor", "per_channel"):
        for fmt in ("int8", "int4"):
            row = rows[("GroupQueryAttention", "cpu", f"{fmt} {g}")]
            assert row.verdict == "proven" and row.outcome.startswith("session created")
        fp8 = rows[("GroupQueryAttention", "cpu", f"fp8 {g}")]
        assert fp8.verdict == "proven" and "NOT_IMPLEMENTED only" in fp8.outcome
    paged = [r for r in report.rows if r.op == "PagedAttention" and r.provider == "cpu"]
    assert len(paged) == 14  # float + 3 formats x 2 granularities, separate and LATENT
    assert all(r.verdict == "proven" and "NOT_IMPLEMENTED only" in r.outcome for r in paged)
    assert not report.disagreements


def test_the_cpu_kernel_is_proven_to_honor_attention_sinks(report):
    """head_sink on the CPU: float, int8 and int4 caches, each head scaled as the sink says."""
    sinks = {r.cache: r for r in report.rows if r.provider == "cpu" and r.cache.endswith("+ head_sink")}
    assert set(sinks) == {"float + head_sink", "int8 per_tensor + head_sink", "int4 per_tensor + head_sink"}
    assert all(r.verdict == "proven" and "1 / (1 + exp(sink))" in r.outcome for r in sinks.values())


def test_a_row_claiming_sinks_with_a_cache_the_kernel_lacks_disagrees(monkeypatch):
    cpu = CAPABILITIES["GroupQueryAttention"]["cpu"]
    claims = dataclasses.replace(cpu.head_sink, formats=frozenset({"int8", "fp8"}))
    monkeypatch.setitem(
        CAPABILITIES["GroupQueryAttention"], "cpu", dataclasses.replace(cpu, head_sink=claims)
    )
    found = doctor.run_doctor(["cpu"])
    assert any("fp8 per_tensor + head_sink" in d and "rejected" in d for d in found.disagreements)


def test_absent_providers_are_schema_only(report):
    cuda = [r for r in report.rows if r.provider == "cuda"]
    assert cuda and all(r.verdict == "schema only" and "types resolve" in r.outcome for r in cuda)
    text = report.format_table()
    assert "PagedAttention on cuda (14 caches" in text and "0 disagrees" in text


@pytest.mark.parametrize("name", ["CUDAExecutionProvider", "cuda", "gpu"])
def test_a_provider_this_build_lacks_is_named(name):
    found = doctor.run_doctor([name])
    assert found.providers == () and found.absent[0].startswith("CUDAExecutionProvider: not in this")
    assert {r.verdict for r in found.rows} == {"schema only"}


@pytest.mark.parametrize("name", ["cpu", "CPU", "CPUExecutionProvider"])
def test_providers_are_named_as_in_the_table_or_as_onnxruntime_does(name):
    assert doctor.run_doctor([name]).providers == ("CPUExecutionProvider",)


def test_an_unknown_provider_is_an_error(capsys):
    with pytest.raises(KvCacheError, match=r"Unknown execution provider 'tpu'.*cpu, cuda"):
        doctor.run_doctor(["tpu"])
    assert main(["doctor", "--provider", "tpu"]) == 2
    assert (
        main(["doctor", "--ep", "cpu", "--provider", "cuda"]) == 1
    )  # asked for, not checked; --ep as elsewhere
    assert "no session checks on CUDAExecutionProvider" in capsys.readouterr().err


def test_a_wrong_row_is_reported_as_a_disagreement(monkeypatch):
    wrong = dataclasses.replace(
        CAPABILITIES["PagedAttention"]["cpu"],
        query_dtypes=frozenset(CAPABILITIES["PagedAttention"]["cuda"].query_dtypes),
        formats={"int8": FormatSupport(frozenset({"per_tensor", "per_channel"}), "1.30")},
    )
    table = {**CAPABILITIES, "PagedAttention": {**CAPABILITIES["PagedAttention"], "cpu": wrong}}
    monkeypatch.setattr(doctor, "CAPABILITIES", table)
    found = doctor.run_doctor(["CPUExecutionProvider"])
    bad = {(r.cache, r.verdict) for r in found.rows if r.op == "PagedAttention" and r.provider == "cpu"}
    assert ("int8 per_tensor", "disagrees") in bad and ("float", "disagrees") in bad
    assert ("fp8 per_tensor", "proven") in bad  # still not listed, still no kernel


def older_runtime(monkeypatch, **changes):
    """Pretend the installed onnxruntime's PagedAttention schema differs as ``changes`` say."""
    real = doctor._schemas()
    schema = real[("com.microsoft", "PagedAttention")]
    inputs = [SimpleNamespace(name=i.name, typeStr=i.typeStr) for i in schema.inputs]
    for slot, name in changes.get("renamed", {}).items():
        inputs[slot].name = name
    attributes = {k: v for k, v in schema.attributes.items() if k not in changes.get("dropped", ())}
    fake = SimpleNamespace(inputs=inputs, type_constraints=schema.type_constraints, attributes=attributes)
    monkeypatch.setattr(doctor, "_schemas", lambda: {**real, ("com.microsoft", "PagedAttention"): fake})


def test_a_schema_that_disagrees_is_reported(monkeypatch):
    older_runtime(monkeypatch, renamed={14: "key_scale"}, dropped=("k_cache_dtype",))
    check = {c.op: c for c in doctor.check_schemas()}["PagedAttention"]
    text = " | ".join(check.problems)
    assert not check.agrees and "14 k_scale!=key_scale" in text and "lacks attributes k_cache_dtype" in text


def test_cli_doctor(capsys, monkeypatch):
    assert main(["doctor", "--provider", "CPUExecutionProvider"]) == 0
    out = capsys.readouterr().out
    assert "PagedAttention: agrees with the table" in out and "0 disagrees" in out
    assert main(["doctor", "--provider", "CPUExecutionProvider", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["disagreements"] == [] and len(doc["rows"]) > 20
    older_runtime(monkeypatch, renamed={3: "k_cache"})
    assert main(["doctor", "--provider", "CPUExecutionProvider"]) == 1
    assert (
        "disagrees with this onnxruntime: PagedAttention schema: input names differ"
        in capsys.readouterr().err
    )


def test_the_openvino_row_is_not_onnxruntimes():
    with pytest.raises(KvCacheError, match="The openvino row is run by openvino, not onnxruntime"):
        doctor.run_doctor(["openvino"])
