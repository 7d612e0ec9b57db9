"""docs/paged.md's Python blocks run as written, and the figures it quotes are the current ones."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest

from onnx_kvcache.errors import KvCacheWarning

PAGE = pathlib.Path(__file__).parents[1] / "docs" / "paged.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_blocks_run(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KvCacheWarning)  # the page's snippets warn about nothing
        exec(compile(BLOCKS[index], f"paged.md block {index}", "exec"), {})
    out = capsys.readouterr().out
    for comment in re.findall(r"print\(.*\)  # (\S+)", BLOCKS[index]):
        if comment[0] in "{[0123456789":
            assert comment.split(" ")[0] in out.replace(" ", ""), comment


def test_the_doctor_output_on_the_page_is_this_machines():
    from onnx_kvcache.doctor import run_doctor

    page = PAGE.read_text()
    report = run_doctor()
    for row in report.rows:
        if row.verdict != "schema only":
            assert f"{row.cache} " in page
    assert report.format_table().splitlines()[-1] in page  # the verdict counts
