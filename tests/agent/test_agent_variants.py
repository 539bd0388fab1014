"""Forks that differ from their base by a Variant: model, instructions, tools, tuning, prompt and transcript
edits each take effect in the fork and nowhere else; the variant is stored with the fork (JSON) and rebuilds the
same agent from the store; a variant that cannot apply fails with a typed error before any fork starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from control_tools import effects, lookup, reset_effects, transfer  # noqa: F401 - reset_effects: autouse

from loomray import Agent, Approve, Edit, Message, Tuning, Variant, VariantError
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime, LocalRuntime
from loomray.variants import describe_variant


def echo_system(request) -> str:
    """A reply that names the instructions the model was given (the transcript's system message)."""
    system = [m.content for m in request.messages if m.role == "system"]
    return f"instructed: {system[0] if system else '-'}"


def echo_tools(request) -> str:
    return "tools: " + ",".join(sorted(t["name"] for t in request.tools))


def echo_system_and_tools(request) -> str:
    return f"{echo_system(request)}; {echo_tools(request)}"


def echo_transcript(request) -> str:
    return " | ".join(f"{m.role}:{m.content}" for m in request.messages)


def search(query: str) -> str:
    """Search the web."""
    effects.append(f"search-{query}")
    return f"found {query}"


def base_agent(runtime, model=None, **kwargs) -> Agent:
    model = model or ScriptedModel(["source ready", echo_system, "base again"], name="base-model")
    return Agent("Be brief.", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=True),
                 **kwargs)


@pytest.fixture
async def source(runtime_factory):
    """A base agent and a session with one finished pass to fork from."""
    agent = base_agent(runtime_factory())
    first = await agent.run("start", session_id="src")
    assert first.output == "source ready"
    return agent, first


async def test_each_field_of_a_variant_takes_effect_in_its_own_fork(source):
    agent, first = source
    other = ScriptedModel(["-", "model b answers"], name="model-b")
    tooled = ScriptedModel(["-", echo_tools], name="tooled")
    forks = await agent.fork("src", from_checkpoint=first.checkpoint_id, variants=[
        Variant(),
        Variant(model=other),
        Variant(instructions="Be thorough."),
        Variant(model=tooled, tools=[search, "lookup"]),
        Variant(prompt="try the other way"),
    ])
    plain, by_model, by_instructions, by_tools, by_prompt = forks
    assert plain.output == "instructed: Be brief."  # the base agent as it is
    assert by_model.output == "model b answers" and other.calls == 1
    assert by_instructions.output == "instructed: Be thorough."
    assert by_instructions.messages[0] == Message(role="system", content="Be thorough.")
    assert by_tools.output == "tools: lookup,search"
    assert by_prompt.messages[-2] == Message(role="user", content="try the other way")
    assert plain.messages[-2].content == "Continue the interrupted task."
    assert len({f.session_id for f in forks}) == 5 and "src" not in {f.session_id for f in forks}
    # The base agent is unchanged by any of it.
    assert (agent.instructions, agent.model.name, sorted(agent.tools)) == ("Be brief.", "base-model", ["lookup"])


async def test_a_variants_tools_run_and_its_tuning_holds(source):
    agent, first = source
    tool_model = ScriptedModel(["-", {"tool": "search", "args": {"query": "ray"}}, "searched"], name="searcher")
    searching, limited = await agent.fork("src", from_checkpoint=first.checkpoint_id, variants=[
        Variant(model=tool_model, tools=[search]),
        Variant(tuning=Tuning(checkpoint=True, max_tokens=1)),
    ])
    assert searching.output == "searched" and effects == ["search-ray"]
    assert [m.content for m in searching.messages if m.role == "tool"] == ["found ray"]
    assert limited.stop_reason == "budget_exceeded"  # the base agent has no limit


async def test_edits_apply_at_the_fork_point_and_leave_the_base_untouched(source):
    agent, first = source
    before = await agent.get_checkpoint("src", first.checkpoint_id)
    listed = [m.checkpoint_id for m in await agent.list_checkpoints("src")]
    agent.model = ScriptedModel([echo_transcript, echo_transcript], name="base-model")
    replaced, dropped, inserted, chained = await agent.fork("src", from_checkpoint="latest", variants=[
        Variant(edits=[Edit.replace(1, Message(role="user", content="begin"))]),
        Variant(edits=[Edit.drop(1)]),
        Variant(edits=[Edit.insert(2, Message(role="user", content="note"))], prompt="go"),
        Variant(edits=[Edit.drop(-1), Edit.insert(-1, Message(role="user", content="hint"))],
                instructions="New rules."),
    ])
    nudge = "user:Continue the interrupted task."
    assert replaced.output == f"system:Be brief. | user:begin | assistant:source ready | {nudge}"
    assert dropped.output == f"system:Be brief. | assistant:source ready | {nudge}"
    assert inserted.output == "system:Be brief. | user:start | user:note | assistant:source ready | user:go"
    assert chained.output == f"system:New rules. | user:hint | user:start | {nudge}"
    # The source session: the same checkpoints, the same transcript.
    assert [m.checkpoint_id for m in await agent.list_checkpoints("src")] == listed
    assert (await agent.get_checkpoint("src", first.checkpoint_id)).messages == before.messages
    # A fork's own checkpoint holds its edited transcript, read back whole.
    ckpt = await agent.get_checkpoint(replaced.session_id)
    assert ckpt.forked_from == "src" and ckpt.messages[1].content == "begin"


async def test_bad_variants_fail_typed_before_anything_runs(source):
    agent, first = source
    sessions = {r.session_id for r in agent.runtime.store.sessions.list()}
    fork = agent.fork
    with pytest.raises(TypeError, match="exactly one"):
        await fork("src", from_checkpoint="latest", prompts=["a"], variants=[Variant()])
    with pytest.raises(TypeError, match="exactly one"):
        await fork("src", from_checkpoint="latest")
    with pytest.raises(TypeError, match="Variant"):
        await fork("src", from_checkpoint="latest", variants=[{"prompt": "a"}])
    with pytest.raises(TypeError):
        await fork("src", from_checkpoint="latest", variants=Variant())
    for bad in ([Edit.drop(3)], [Edit.replace(-4, Message(role="user", content="x"))],
                [Edit.drop(0)] * 4, [Edit.insert(4, Message(role="user", content="x"))]):
        with pytest.raises(VariantError, match="outside a transcript"):
            await fork("src", from_checkpoint=first.checkpoint_id, variants=[Variant(), Variant(edits=bad)])
    with pytest.raises(VariantError, match="no-such-model"):
        await fork("src", from_checkpoint="latest", variants=[Variant(model="no-such-model")])
    with pytest.raises(VariantError, match="does not have"):
        await fork("src", from_checkpoint="latest", variants=[Variant(tools=["search"])])
    with pytest.raises(ValueError):  # VariantError is a user error, a ValueError
        await fork("src", from_checkpoint="latest", variants=[Variant(edits=[Edit.drop(9)])])
    # Nothing started: no fork session exists.
    assert {r.session_id for r in agent.runtime.store.sessions.list()} == sessions
    with pytest.raises(TypeError):
        Edit.replace(0, "not a message")
    with pytest.raises(TypeError):
        Variant(tuning={"max_turns": 3})


def test_the_stored_form_is_json_and_reads_back(tmp_path):
    v = Variant(prompt="p", model=ScriptedModel([], name="model-b"), instructions="i", tools=[search, "lookup"],
                tuning=Tuning(checkpoint=True, max_tokens=5),
                edits=[Edit.replace(0, Message(role="user", content="x")), Edit.drop(-1)])
    stored = json.loads(json.dumps(v.to_json()))
    assert stored["model"] == "model-b" and stored["tools"] == ["search", "lookup"]
    back = Variant.from_json(stored)
    assert (back.model, back.tools, back.tuning, back.edits) == ("model-b", ("search", "lookup"), v.tuning, v.edits)
    assert back.to_json() == stored
    assert describe_variant(stored) == ("model=model-b; instructions='i'; prompt='p'; tools=[search, lookup]; "
                                        "tuning(checkpoint=True, max_tokens=5); edits: replace 0 (user), drop -1")
    assert Variant().describe() == "no change"
    for bad in ([], {"model": 3}, {"tools": "search"}, {"tools": 1}, {"colour": "red"}, {"tuning": {"max_turns": 0}},
                {"edits": [{"op": "shred", "index": 0}]}, {"edits": [{"op": "drop"}]}):
        with pytest.raises(VariantError):
            Variant.from_json(bad)


async def test_a_fork_continued_from_the_store_runs_the_same_variant(tmp_path):
    """The fork stops for an approval; a fresh base agent (another process, say) continues it: the variant is
    rebuilt from the fork's run record (instructions, tools by name, tuning), the approval edits the call."""
    calls = tmp_path / "calls"

    def make() -> Agent:
        model = ScriptedModel(["ready", {"tool": "transfer", "args": {"amount": 3}}, echo_system_and_tools],
                              name="base-model", counter_path=calls)
        return Agent("Be brief.", model=model, tools=[lookup, transfer], runtime=LocalRuntime(tmp_path / "store"),
                     tuning=Tuning(checkpoint=True))

    first = await make().run("start", session_id="src")
    variant = Variant(instructions="Ask twice.", tools=["transfer"], tuning=Tuning(checkpoint=True, max_turns=7))
    [waiting] = await make().fork("src", from_checkpoint=first.checkpoint_id, variants=[variant])
    assert waiting.stop_reason == "awaiting_approval"
    [record] = make().runtime.store.runs.list(waiting.session_id)
    assert record.request["variant"] == variant.to_json()  # stored with the fork, as JSON

    done = await make().resume(None, session_id=waiting.session_id,
                               approvals={waiting.pending_approvals[0].id: Approve(arguments={"amount": 2})})
    assert done.stop_reason == "completed" and done.output == "instructed: Ask twice.; tools: transfer"
    assert effects == ["transfer-2"]
    assert [int(x) for x in calls.read_text().split()] == [0, 1, 2]  # no model call made twice


async def test_a_variant_model_the_store_cannot_name_needs_the_variants_agent(tmp_path):
    """A model instance is stored by name; one no resolver knows is rebuilt only by ``with_variant``."""
    def make() -> Agent:
        model = ScriptedModel(["ready", {"tool": "transfer", "args": {"amount": 3}}, "base done"], name="base")
        return Agent("Be brief.", model=model, tools=[transfer], runtime=LocalRuntime(tmp_path),
                     tuning=Tuning(checkpoint=True))

    variant = Variant(model=ScriptedModel(["-", {"tool": "transfer", "args": {"amount": 4}}, "b done"], name="b"))
    first = await make().run("start", session_id="src")
    [waiting] = await make().fork("src", from_checkpoint=first.checkpoint_id, variants=[variant])
    call = waiting.pending_approvals[0].id
    with pytest.raises(VariantError, match="model 'b' cannot be used"):
        await make().resume(None, session_id=waiting.session_id, approvals={call: True})
    done = await make().with_variant(variant).resume(None, session_id=waiting.session_id)
    assert done.output == "b done" and effects == ["transfer-4"]


async def test_prompts_still_fork_as_before():
    agent = base_agent(InProcRuntime())
    first = await agent.run("start", session_id="src")
    forks = await agent.fork("src", from_checkpoint=first.checkpoint_id, prompts=["a", "b"])
    assert [f.messages[-2].content for f in forks] == ["a", "b"]
    assert all(r.request.get("variant") is None for f in forks for r in agent.runtime.store.runs.list(f.session_id))


async def test_tree_and_show_say_what_each_variant_changed(tmp_path):
    import os

    from forked import run_loomray

    store = tmp_path / "store"
    agent = base_agent(LocalRuntime(store))
    first = await agent.run("start", session_id="src")
    thorough, edited, plain = await agent.fork("src", from_checkpoint=first.checkpoint_id, variants=[
        Variant(instructions="Be thorough.", tools=[search]),
        Variant(edits=[Edit.drop(1)], tuning=Tuning(checkpoint=True, max_turns=3)),
        Variant(),
    ])
    [prompted] = await agent.fork("src", from_checkpoint=first.checkpoint_id, prompts=["p"])
    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")} | {"COLUMNS": "160"}

    def cli(*args: str):
        out = run_loomray([*args, "--store", str(store)], env=env, cwd=Path(__file__).resolve().parents[2], timeout=90)
        assert out.returncode == 0, out.stderr
        return out.stdout

    tree = json.loads(cli("tree", "src", "--json"))
    variants = {c["session_id"]: c["variant"] for c in tree["tree"]["children"]}
    assert variants == {thorough.session_id: {"instructions": "Be thorough.", "tools": ["search"]},
                        edited.session_id: {"edits": [{"op": "drop", "index": 1}],
                                            "tuning": {**variants[edited.session_id]["tuning"], "max_turns": 3}},
                        plain.session_id: {}, prompted.session_id: None}
    table = cli("tree", "src")
    row = {sid: next(line for line in table.splitlines() if sid in line)
           for sid in (thorough.session_id, edited.session_id, plain.session_id)}
    assert "instructions='Be thorough.'; tools=[search]" in row[thorough.session_id]
    assert "tuning(checkpoint=True, max_turns=3); edits: drop 1" in row[edited.session_id]
    assert "no change" in row[plain.session_id]
    shown = cli("show", thorough.session_id, "--no-messages")
    assert "variant: instructions='Be thorough.'; tools=[search]" in shown
    assert "variant:" not in cli("show", prompted.session_id, "--no-messages")
    page = tmp_path / "tree.html"
    cli("tree", "src", "--html", str(page))
    assert "edits: drop 1" in page.read_text()


async def test_the_fork_command_takes_variants_as_json(tmp_path):
    import os

    from forked import run_loomray

    from loomray.cli.demo_agent import RESEARCH_AGENT_REF, research_agent
    from loomray.runtime.actors import set_agent_ref

    store = tmp_path / "store"
    agent = copy_with_runtime(research_agent, LocalRuntime(store))
    set_agent_ref(agent, RESEARCH_AGENT_REF)
    await agent.run("durable agents", session_id="s-cli")
    base = (await agent.list_checkpoints("s-cli"))[-1]  # the oldest kept
    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")} | {"COLUMNS": "160"}

    def cli(*args: str, code: int = 0):
        out = run_loomray(["fork", "s-cli", "--from", base.checkpoint_id, "--agent", RESEARCH_AGENT_REF, *args,
                           "--store", str(store)], env=env, cwd=Path(__file__).resolve().parents[2], timeout=120)
        assert out.returncode == code, out.stderr
        return out

    terse = {"instructions": "Be terse.", "tuning": {"checkpoint": True, "max_turns": 40}}
    hinted = {"prompt": "Mind the costs.",
              "edits": [{"op": "insert", "index": 1, "message": {"role": "user", "content": "Context: costs."}}]}
    (tmp_path / "hinted.json").write_text(json.dumps(hinted))
    forks = json.loads(cli("--variant", json.dumps(terse), "--variant", f"@{tmp_path / 'hinted.json'}",
                           "--json").stdout)
    assert [f["variant"] for f in forks] == [Variant.from_json(terse).to_json(), hinted]
    first, second = [await agent.get_checkpoint(f["session_id"]) for f in forks]
    assert first.messages[0].content == "Be terse." and first.forked_from == "s-cli"
    assert second.messages[1].content == "Context: costs." and second.messages[base.message_count + 1].content \
        == "Mind the costs."
    # Mistakes are one line each, exit 2, and start nothing.
    before = {r.session_id for r in agent.runtime.store.sessions.list()}
    for args, said in [(["--variant", '{"colour": 1}'], "unknown field"),
                       (["--variant", "{not json"], "not JSON"),
                       (["--variant", "@/nonexistent/v.json"], "cannot read variant file"),
                       (["--variant", "{}", "--prompt", "x"], "not both"),
                       ([], "not both"),
                       (["--variant", '{"edits": [{"op": "drop", "index": 99}]}'], "outside a transcript")]:
        out = cli(*args, code=2)
        assert said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert {r.session_id for r in agent.runtime.store.sessions.list()} == before


def copy_with_runtime(agent: Agent, runtime) -> Agent:
    import copy

    mine = copy.copy(agent)
    mine.runtime = runtime
    return mine
