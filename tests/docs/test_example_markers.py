"""The example convention itself ([Note: example markers] in tests/docs/examples.py) on small pages."""

from __future__ import annotations

import pytest

from tests.docs.examples import examples_of

PAGE = """# A page

```python
a = 1
```

<!-- example: continues -->
```python
assert a == 1
```

<!-- example: torchrun 2 -->
```python
import torch.distributed
```

<!-- example: skip (needs a GPU) -->
```python
import nothing_here
```

```bash
rm -rf /
```

```toml
partitioner = "zero3"
```
"""


def test_markers_select_how_each_block_runs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = examples_of(page)
    assert [(e.mode, e.line) for e in found] == [
        ("python", 3), ("python", 8), ("torchrun", 13), ("skip", 18), ("config", 26)
    ]
    assert found[1].code == "a = 1\n\nassert a == 1\n"  # continues: the previous block prepended
    assert found[2].nproc == 2
    assert found[3].reason == "needs a GPU"
    assert found[0].id.endswith("page.md:3")


@pytest.mark.parametrize("marker", ["<!-- example: skip -->", "<!-- example: skip () -->", "<!-- example: torchrun -->",
                                    "<!-- example: run -->"])
def test_a_malformed_marker_is_an_error_naming_its_line(tmp_path, marker):
    page = tmp_path / "page.md"
    page.write_text(f"text\n\n{marker}\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="page.md:3: malformed example marker"):
        examples_of(page)


def test_continues_needs_a_block_before_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- example: continues -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="'continues' with no python block"):
        examples_of(page)


def test_a_marker_must_sit_right_before_its_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- example: skip (needs a GPU) -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="page.md:1: an example marker must be the line right before a fence"):
        examples_of(page)
