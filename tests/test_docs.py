"""The README and docs/ say what the software does: their code runs, and what they list matches the code.

The README's training example runs against a proxy over the fake vLLM and queues a training step; the SDK page's
reference is what ``docs/sdk_reference.py`` writes from the package; every route of the apps is in OPERATIONS.md's
table; the dashboard's pages are named alike in the code, OBSERVABILITY.md and the README; every schema revision
the docs name exists; the README's figures are rows of BENCHMARKS.md's table of current figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import RunningProxy

import tracetrain
from proxy import Settings, create_app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}


def python_block(text: str, containing: str) -> str:
    [block] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if containing in b]
    return block


def run_as_a_script(code: str) -> None:
    """``code`` in a process of its own, as a user's script runs (its clients are left to the process's end)."""
    env = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"}  # offline: the Agents SDK exports traces otherwise
    ran = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], env=env,
                         capture_output=True, text=True, check=False, timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stderr


def section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same level or higher."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
    return rest[: ends[0]] if ends else rest


def test_the_readmes_python_example_fills_groups_that_make_a_training_step(proxy: RunningProxy) -> None:
    code = python_block(README, "min-group-size")
    assert "--min-group-size (2)" in code and proxy.settings.min_group_size == 2  # what it says is the default
    run_as_a_script(code.replace("http://127.0.0.1:8100", proxy.url))

    groups = proxy.rows("SELECT id, state FROM groups ORDER BY id")
    assert [g["id"] for g in groups] == ["capital-Chile", "capital-Japan", "capital-Kenya", "capital-Peru"]
    rewarded = proxy.rows("SELECT group_id, count(*) AS n FROM trajectories WHERE reward IS NOT NULL GROUP BY group_id")
    assert {r["n"] for r in rewarded} == {4}
    [job] = proxy.rows("SELECT group_ids, state FROM training_jobs")  # the step the four groups make
    assert job["state"] == "queued"
    assert sorted(re.findall(r"capital-\w+", job["group_ids"])) == [g["id"] for g in groups]


def test_the_readmes_agent_clients_reach_the_policy(proxy: RunningProxy) -> None:
    code = python_block(README, "set_default_openai_client")
    code += "\nchat.chat.completions.create(model='agent', messages=[{'role': 'user', 'content': 'hi'}])"
    code += "\nclaude.messages.create(model='agent', max_tokens=16, messages=[{'role': 'user', 'content': 'hi'}])"
    run_as_a_script(code.replace("http://127.0.0.1:8100", proxy.url))
    endpoints = {row["endpoint"] for row in proxy.rows("SELECT endpoint FROM calls")}
    assert endpoints == {"responses", "chat.completions", "messages"}


def test_the_sdk_page_is_what_the_package_says_and_names_every_public_name() -> None:
    check = subprocess.run([sys.executable, str(ROOT / "docs" / "sdk_reference.py"), "--check"], capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert check.returncode == 0, check.stderr
    page = DOCS["SDK.md"]
    for name in tracetrain.__all__:
        assert re.search(rf"`{name}\b", page), name
    for method in ("post_reward", "post_rewards", "list_trajectories", "iter_trajectories", "get_trajectory",
                   "list_groups", "iter_groups", "openai_base_url"):  # fmt: skip
        assert f"`Client.{method}(" in page and f"AsyncClient.{method}(" in page, method


def test_every_v1_and_admin_route_is_in_the_http_table(tmp_path: Path) -> None:
    table = section(DOCS["OPERATIONS.md"], "## The HTTP API")
    listed = {(method, re.sub(r"\{[^}]*\}", "{}", path)) for method, path in
              re.findall(r"`(GET|POST|PATCH|PUT|DELETE) (/[^`\s]*)`", table)}  # fmt: skip
    app = create_app(Settings(upstream="http://127.0.0.1:9/v1", data_dir=tmp_path))  # type: ignore[call-arg]
    missing = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if not path.startswith(("/v1/", "/admin")) or path.startswith("/admin/ui"):
            continue  # the prefixed copies of /v1 (/t/..., /g/...) and the dashboard's pages are named once there
        for method in sorted(set(getattr(route, "methods", ())) - {"HEAD"}):
            if (method, re.sub(r"\{[^}]*\}", "{}", path)) not in listed:
                missing.append(f"{method} {path}")
    assert not missing, f"docs/OPERATIONS.md's HTTP table lacks {missing}"


def test_the_dashboards_pages_are_named_alike_in_the_code_and_the_docs() -> None:
    base = (ROOT / "proxy" / "api" / "templates" / "base.html").read_text()
    pages = re.findall(r'\("/admin[^"]*", "(\w+)"\)', base)
    assert len(pages) >= 8
    table = section(DOCS["OBSERVABILITY.md"], "## The dashboard")
    assert re.findall(r"^\| (\w+) \|", table, re.M)[1:] == pages  # the first row is the header
    readme = section(README, "## The dashboard")
    assert ", ".join(pages[:-1]) + " and " + pages[-1] in readme.replace("\n", " ")


def test_the_docs_name_only_schema_revisions_that_exist() -> None:
    revisions = {p.stem for p in (ROOT / "store" / "migrations" / "versions").glob("0*.py")}
    for name, text in {"README.md": README, **DOCS}.items():
        for named in re.findall(r"\b\d{4}_[a-z0-9_]+\b", text):
            assert named in revisions, f"{name} names the schema revision {named}, which does not exist"


def test_the_readmes_figures_are_rows_of_the_benchmarks_table() -> None:
    figures = README.split("<!-- figures:")[1].split("<!-- end of figures -->")[0]
    rows = [line for line in figures.splitlines() if line.startswith("| ") and not line.startswith("| what |")]
    assert len(rows) >= 3
    current = section(DOCS["BENCHMARKS.md"], "## Current figures")
    for row in rows:
        assert row in current.splitlines(), f"README's figure is not in docs/BENCHMARKS.md: {row}"
    outside = README.replace(figures, "")
    for points in re.findall(r"[+-]\d+(?:\.\d+)? (?:points|held-out points)", outside):
        assert points in DOCS["BENCHMARKS.md"], points


def test_the_readme_lists_every_extra_and_every_command() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = section(README, "## Set-up")
    listed = {name for cell in re.findall(r"^\| (`[^|]*`) \|", table, re.M) for name in re.findall(r"`([\w-]+)`", cell)}
    assert listed == set(extras)
    commands = section(README, "## The other commands")
    nested = [f"{top} {c}" for top in ("db", "model", "config") for c in subcommands(top)]
    for command in [*subcommands(), *nested]:
        if command not in ("serve", "db", "model", "config"):
            assert f"`tracetrain {command}`" in commands or f"`{command}`" in commands, command


def subcommands(*command: str) -> list[str]:
    """The commands ``tracetrain [COMMAND] --help`` lists."""
    shown = subprocess.run([sys.executable, "-m", "tracetrain_cli", *command, "--help"], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    return re.findall(r"^    (\w+)\s", shown, re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, blanks to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_section_of_the_docs_finds_it() -> None:
    pages = {"README.md": README, **{f"docs/{name}": text for name, text in DOCS.items()}}
    anchors = {name: {anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)} for name, text in pages.items()}
    broken = []
    for name, text in pages.items():
        here = Path(name).parent
        for target, fragment in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", text):
            page = name if not target else str(Path(here, target)).removeprefix("docs/../")
            if page in anchors and fragment not in anchors[page]:
                broken.append(f"{name}: {target}#{fragment}")
    assert not broken
