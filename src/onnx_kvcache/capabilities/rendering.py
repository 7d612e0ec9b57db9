"""The capability rows (:mod:`.rows`) as Markdown: the table docs/capabilities.md shows."""

from __future__ import annotations

__all__ = ["render_capability_table"]

from onnx_kvcache.cache.formats import CACHE_FORMATS
from onnx_kvcache.capabilities.rows import CAPABILITIES, FAST_PATHS, STORAGE_CAPABILITIES, EpCapabilities


def _format_cell(row: EpCapabilities, name: str) -> str:
    support = row.formats.get(name)
    if support is None:
        return "no"
    runtime = "ORT" if row.runtime == "onnxruntime" else row.runtime
    cell = f"{runtime} >= {support.min_version}, " + " + ".join(sorted(support.granularities))
    if support.min_compute_capability:
        cell += ", SM {}.{}+".format(*support.min_compute_capability)
    cell += f" ({support.evidence})"
    if support.note:
        cell += f"; {support.note}"
    if support.warning:
        cell += " Warns at conversion."
    return cell


def _sink_cell(row: EpCapabilities) -> str:
    """Attention sinks (``head_sink``): since which version, with which quantized caches."""
    sinks = row.head_sink
    if sinks is None:
        return "no"
    runtime = "ORT" if row.runtime == "onnxruntime" else row.runtime
    caches = ", ".join(["float", *sorted(sinks.formats)])
    return f"{runtime} >= {sinks.min_version}: {caches} ({sinks.evidence}); {sinks.note}"


def render_capability_table() -> str:
    """The capability tables (one per operator) and the fast-path rules, as Markdown."""

    lines: list[str] = []
    for op_type, table in CAPABILITIES.items():
        if lines:
            lines.append("")
        lines += [
            f"**{op_type}**",
            "",
            "| provider | query dtypes | q/k norm | rotation | query_seqlens | attention sinks | "
            + " | ".join(CACHE_FORMATS)
            + " | note |",
            "|---|---|---|---|---|---|" + "---|" * len(CACHE_FORMATS) + "---|",
        ]
        for row in table.values():
            cells = [_format_cell(row, name) for name in CACHE_FORMATS]
            dtypes = ", ".join(sorted(t.name.lower() for t in row.query_dtypes)) or "- (no kernel)"
            label = f"`{row.name}` ({row.provider})" if row.provider else f"`{row.name}`"
            norm = "yes" if row.qk_norm else "no"
            turned = f"yes ({row.rotation})" if row.rotation else "no"
            sinks = _sink_cell(row)
            chunks = f"ORT >= {row.query_seqlens}" if row.query_seqlens else "no"
            lines.append(
                f"| {label} | {dtypes} | {norm} | {turned} | {chunks} | {sinks} | "
                + " | ".join(cells)
                + f" | {row.note} |"
            )
    lines += _storage_table()
    lines += [
        "",
        "**CUDA decode fast path (XQA)**",
        "",
        "| operator | head sizes | group sizes (quantized) | formats | GPU | other | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for rule in FAST_PATHS.values():
        other = []
        if rule.needs_shared_buffer:
            other.append("past and present share one buffer")
        if rule.one_scale_tensor_before:
            other.append(f"one k/v scale tensor before ORT {rule.one_scale_tensor_before}")
        gpu = "SM {}.{}+".format(*rule.min_compute_capability) if rule.min_compute_capability else "-"
        heads, groups = ", ".join(map(str, rule.head_sizes)), ", ".join(map(str, rule.group_sizes))
        lines.append(
            f"| {rule.op} | {heads} | {groups} | {', '.join(rule.formats)} | {gpu} | "
            f"{'; '.join(other) or '-'} | {rule.note} |"
        )
    return "\n".join(lines)


def _storage_table() -> list[str]:
    """``storage="qdq"``: the providers that run a cache stored through QuantizeLinear/DequantizeLinear."""
    lines = [
        "",
        '**Storage through QuantizeLinear/DequantizeLinear** (`storage="qdq"`; other providers: refused)',
        "",
        "| provider | " + " | ".join(CACHE_FORMATS) + " | note |",
        "|---|" + "---|" * len(CACHE_FORMATS) + "---|",
    ]
    for row in STORAGE_CAPABILITIES.values():
        label = f"`{row.name}` ({row.provider})" if row.provider else f"`{row.name}`"
        cells = " | ".join(_format_cell(row, name) for name in CACHE_FORMATS)
        lines.append(f"| {label} | {cells} | {row.note} |")
    return lines
