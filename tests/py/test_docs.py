"""The docs fold: no prose sentence is stated twice between the README and docs/*.md."""

from __future__ import annotations

import difflib
import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def prose_sentences(text: str) -> list[str]:
    """Sentences of 20+ characters outside code blocks, whitespace and case folded."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    out = []
    for paragraph in re.split(r"\n\s*\n", prose):
        paragraph = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[.!?:;])\s+(?=[A-Z`(*\-|])", paragraph):
            if len(sentence) >= 20:
                out.append(sentence.lower())
    return out


def repeated(files: dict[str, str], threshold: float = 0.85) -> list[tuple[str, str, str]]:
    found = []
    sentences = {name: prose_sentences(text) for name, text in files.items()}
    for a, b in itertools.combinations(sentences, 2):
        for one in sentences[a]:
            for other in sentences[b]:
                matcher = difflib.SequenceMatcher(None, one, other)
                if (matcher.real_quick_ratio() > threshold and matcher.quick_ratio() > threshold
                        and matcher.ratio() > threshold):
                    found.append((a, b, one))
    return found


def test_no_sentence_twice_between_readme_and_docs():
    files = {name: (ROOT / name).read_text() for name in DOCS}
    assert repeated(files) == []


def test_the_check_finds_a_repeated_sentence():
    sentence = "The pass keeps every sharding annotation of the lowered module."
    files = {"a.md": f"Intro.\n\n{sentence}\n", "b.md": f"Other words here.\n\n{sentence}\n"}
    assert repeated(files) == [("a.md", "b.md", sentence.lower())]


def test_design_doc_cites_only_paths_and_names_that_exist():
    """docs/design.md is the map a newcomer follows: every file it cites exists, and so
    does every function it names in its file."""
    text = (ROOT / "docs" / "design.md").read_text()
    cited = set(re.findall(r"(?<![\w/])((?:hlo_amp|tests|benchmarks|docs|passes|runtime)/"
                           r"[\w/.]+\.(?:py|mlir|md))", text))
    cited |= {f"docs/{name}" for name in re.findall(r"(?<![\w/])(\w+\.md)\b", text)
              if name != "DOT_LAYOUT.md"}
    missing = [path for path in cited
               if not any((ROOT / prefix / path).exists() for prefix in ("", "hlo_amp"))]
    assert cited and not missing, missing
    source = "\n".join(p.read_text() for p in (ROOT / "hlo_amp").rglob("*.py"))
    names = {"default_pipeline", "pass_names", "lowering_target", "matrix_result_in_16bit",
             "mark_kept_by_xla", "resolve_target", "compile_for_target", "amp_call_p",
             "refuse_policy_on_device"}
    assert all(name in text for name in names)
    defined = re.compile(r"^(?:def (\w+)|(\w+) = )", re.MULTILINE).findall(source)
    assert names <= {name for pair in defined for name in pair}
    assert "shared/DESIGN" not in (ROOT / "README.md").read_text()
