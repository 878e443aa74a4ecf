"""E2B's template builds (Template.build) through the gateway, with E2B's
own Python SDK: files uploaded by COPY steps (symlinks kept), RUN as the
template's user or another, ENV, WORKDIR, a start command with a ready
check, tags, Template.exists, then Sandbox.create of the template."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_file


def _context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "folder" / "sub").mkdir(parents=True)
    (ctx / "folder" / "test.txt").write_text("This is a test file.")
    (ctx / "folder" / "sub" / "deep.txt").write_text("deep")
    os.symlink("test.txt", ctx / "folder" / "symlink.txt")
    os.symlink("/nonexistent/target", ctx / "folder" / "dangling")
    (ctx / "run.sh").write_text("#!/bin/sh\necho ran\n")
    return ctx


def test_build_a_template_and_create_sandboxes_of_it(tmp_path: Path):
    ctx = _context(tmp_path)
    template = (
        Template(file_context_path=str(ctx))
        .from_base_image()
        .copy("folder/*", "folder")
        .copy("run.sh", "/opt/tools/", mode=0o755)
        .run_cmd("cat folder/test.txt && ls -la folder")
        .set_envs({"GREETING": "hello world", "QUOTED": 'say "hi"'})
        .run_cmd("whoami > /tmp/built-as && pwd > /tmp/built-in", user="root")
        .set_workdir("/app")
        .run_cmd("touch made-by-user")
        .set_start_cmd("echo started > /tmp/started", wait_for_file("/tmp/started"))
    )
    name = f"tpl-{secrets.token_hex(3)}"
    logs = []
    info = Template.build(template, f"{name}:v1", tags=["stable"], cpu_count=1, memory_mb=512, on_build_logs=logs.append)
    assert sorted(info.tags) == ["stable", "v1"]
    text = "\n".join(str(e.message) for e in logs)
    assert "This is a test file." in text, text
    assert Template.exists(name)
    assert not Template.exists(f"none-{secrets.token_hex(3)}")

    assigned = Template.assign_tags(f"{name}:v1", ["prod"])
    assert assigned.tags == ["prod"]
    tags = {t.tag: t for t in Template.get_tags(name)}
    assert set(tags) == {"v1", "stable", "prod"}, tags
    assert str(tags["prod"].build_id) == str(tags["v1"].build_id)
    Template.remove_tags(name, "prod")
    assert {t.tag for t in Template.get_tags(name)} == {"v1", "stable"}
    with pytest.raises(Exception):
        Template.assign_tags(f"{name}:nope", ["x"])

    sb = Sandbox.create(f"{name}:stable", timeout=120)
    try:
        r = sb.commands.run(
            "cat folder/test.txt; echo; readlink folder/symlink.txt; readlink folder/dangling; "
            "cat folder/sub/deep.txt; echo; /opt/tools/run.sh; echo \"$GREETING|$QUOTED\"; pwd; whoami; "
            "cat /tmp/built-as /tmp/built-in /tmp/started; stat -c %U /app/made-by-user /home/user/folder/test.txt",
            cwd="/home/user",
        )
        assert r.stdout.split("\n")[:-1] == [
            "This is a test file.",
            "test.txt",
            "/nonexistent/target",
            "deep",
            "ran",
            'hello world|say "hi"',
            "/home/user",
            "user",
            "root",
            "/home/user",
            "started",
            "user",
            "user",
        ], r.stdout
        assert sb.commands.run("pwd").stdout.strip() == "/app"
    finally:
        sb.kill()

    # A second build of the same steps is all cache.
    logs.clear()
    Template.build(template, f"{name}:v2", cpu_count=1, memory_mb=512, on_build_logs=logs.append)
    assert sum("--> cached" in str(e.message) for e in logs) >= 6, "\n".join(str(e.message) for e in logs)
    # No "default" tag was built: the bare name is not a template.
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=60)


def test_a_failing_step_names_itself():
    template = Template().from_base_image().run_cmd("echo fine").run_cmd("echo broken >&2; exit 3")
    with pytest.raises(BuildException) as e:
        Template.build(template, f"bad-{secrets.token_hex(3)}", cpu_count=1, memory_mb=512)
    assert "exit code 3" in str(e.value), str(e.value)


def test_a_build_from_a_template_keeps_its_user_and_files(tmp_path: Path):
    base = f"parent-{secrets.token_hex(3)}"
    Template.build(Template().from_base_image().run_cmd("echo parent > marker").set_workdir("/work/proj"), base, cpu_count=1, memory_mb=512)
    child = f"child-{secrets.token_hex(3)}"
    logs = []
    try:
        Template.build(Template().from_template(base).run_cmd("cat /home/user/marker > child && whoami >> child"), child, cpu_count=1, memory_mb=512, on_build_logs=logs.append)
    except BuildException:
        pytest.fail("\n".join(str(e.message) for e in logs))
    sb = Sandbox.create(child, timeout=60)
    try:
        assert sb.commands.run("cat /work/proj/child").stdout == "parent\nuser\n"
    finally:
        sb.kill()
