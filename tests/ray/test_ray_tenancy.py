"""Tenants on one cluster stay apart: session actor names are injective over (store, user, session).

Ids may contain ``:``, the separator of actor names; a name that joined raw
ids gave user ``org:1`` / session ``x`` and user ``org`` / session ``1:x``
one actor, and the supervisor killed (or adopted) the other user's actor.
"""

import asyncio
import itertools
import json
import random
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from loomray.runtime.actors import session_actor_name, store_key  # noqa: E402
from loomray.storage.errors import InvalidIdError  # noqa: E402
from loomray.storage.ids import user_from_segment, validate_id  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

#: Every printable ASCII character the id validator accepts, plus letters outside ASCII; ':' and '_' weighted up.
_ASCII = [chr(c) for c in range(0x20, 0x7F) if chr(c) not in "/\\=%"]
_ALPHABET = _ASCII + list("éß漢字ÿ") + [":"] * 20 + ["_"] * 5


def _random_id(rng: random.Random, what: str = "session_id") -> str:
    while True:
        value = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 12)))
        try:
            validate_id(value)
        except InvalidIdError:
            continue  # '..' and the like: not an id, so not a case
        if what == "session_id" or value != "_":  # '_' is "no user", not a user id
            return value


def _parse_name(name: str) -> tuple[str, str | None, str]:
    """``(store key, user_id, session_id)`` of a session actor's name: the inverse the name format allows."""
    prefix, key, user, session = name.split(":")
    assert prefix == "loomray"
    return key, user_from_segment(user.replace("%3A", ":")), session.replace("%3A", ":")


def test_actor_names_are_injective_for_every_character_ids_accept():
    url = "file:///tmp/store"
    rng = random.Random(23)
    seen: dict[str, tuple[str | None, str]] = {}
    pairs = [(None if rng.random() < 0.1 else _random_id(rng, "user_id"), _random_id(rng)) for _ in range(20_000)]
    # Exhaustively too, over a small alphabet rich in separators: every split of a string at its ':'s.
    small = ["".join(p) for n in (1, 2, 3) for p in itertools.product(":a1_", repeat=n)]
    small = [s for s in small if s != "_"]
    pairs += [(u, s) for u in [None, *small] for s in small]
    for user, session in pairs:
        name = session_actor_name(url, session, user)
        assert _parse_name(name) == (store_key(url), user, session)  # a left inverse: injective
        assert seen.setdefault(name, (user, session)) == (user, session)
    assert session_actor_name(url, "x", "org:1") != session_actor_name(url, "1:x", "org")


def test_actor_names_refuse_what_ids_refuse():
    with pytest.raises(InvalidIdError):
        session_actor_name("file:///tmp/store", "a/b")
    with pytest.raises(InvalidIdError):
        session_actor_name("file:///tmp/store", "s", "_")  # '_' is "no user"


@pytest.fixture(scope="module")
def runtime(shared_cluster, tmp_path_factory):
    from loomray.runtime import RayRuntime

    # Every session starts an actor under its own name, where the collision was.
    rt = RayRuntime(tmp_path_factory.mktemp("ray-tenancy") / "store",
                    actor_options={"resources": {"loomray_session": 1}})
    yield rt
    rt.close()


async def test_users_whose_ids_join_alike_get_their_own_actors(runtime):
    import ray_agents

    from loomray.runtime.actors import NAMESPACE

    tenants = {("org:1", "x"): "tenant_a", ("org", "1:x"): "tenant_b"}
    agents = {}
    for key, name in tenants.items():
        agent = ray_agents.make(name, 0.15)
        agent.runtime = runtime
        agents[key] = agent
    runs = [asyncio.create_task(agents[(u, s)].run("go", session_id=s, user_id=u)) for u, s in tenants]
    names = {session_actor_name(runtime.config.store_url, s, u) for u, s in tenants}
    assert len(names) == 2

    def both_alive():
        live = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
        return names <= live

    deadline = asyncio.get_running_loop().time() + 60
    while not both_alive():  # both actors run at once: neither start killed nor adopted the other's
        assert asyncio.get_running_loop().time() < deadline, "both session actors never ran at once"
        assert not any(r.done() for r in runs), [r.result() for r in runs if r.done()]
        await asyncio.sleep(0.05)
    results = await asyncio.wait_for(asyncio.gather(*runs), 120)

    for ((user, session), name), result in zip(tenants.items(), results, strict=True):
        assert (result.session_id, result.output) == (session, f"{name} finished")
        assert ray_agents.model_calls(name) == list(range(ray_agents.TURNS + 1))  # one incarnation, no restart
        assert runtime.store.sessions.get(session, user_id=user).status == "completed"


async def test_secrets_in_runtime_env_and_actor_options_never_reach_the_store(runtime, tmp_path):
    """The Ray-only channels of the secrets sweep (tests/agent/test_agent_secrets_sweep.py has the others):
    an env var secret by name and one by its value's shape reach the session's actor, never the bucket."""
    from loomray import Agent
    from loomray.models import ScriptedModel
    from loomray.runtime import RayRuntime

    by_name, by_shape = "plain-MARKER-runtime-env-7f3a", "sk-MARKER-actor-option-7f3a"
    release = tmp_path / "release"

    async def check_env() -> str:
        """Whether this worker got its keys (never the keys themselves)."""
        import os

        while not release.exists():
            await asyncio.sleep(0.05)
        got = (os.environ.get("ANTHROPIC_API_KEY"), os.environ.get("HARMLESS"), os.environ.get("LOG_LEVEL"))
        return "env ok" if got == (by_name, by_shape, "debug") else "env missing"

    options = {"resources": {"loomray_session": 1},
               "runtime_env": {"env_vars": {"ANTHROPIC_API_KEY": by_name, "HARMLESS": by_shape, "LOG_LEVEL": "debug"}}}
    secret_rt = RayRuntime(runtime.config.store_url, actor_options=options)
    try:
        agent = Agent("x", model=ScriptedModel([{"tool": "check_env", "args": {}}, "done"]), tools=[check_env],
                      runtime=secret_rt)
        run = asyncio.create_task(agent.run("go", session_id="s-env", user_id="tenant"))
        deadline = asyncio.get_running_loop().time() + 60
        while (mark := secret_rt.store.active.get("s-env", user_id="tenant")) is None:
            assert asyncio.get_running_loop().time() < deadline and not run.done(), "the session was never marked"
            await asyncio.sleep(0.05)
        stored = json.loads(mark)
        assert stored["secret_env_vars"] == ["ANTHROPIC_API_KEY", "HARMLESS"]
        assert stored["actor_options"]["runtime_env"] == {"env_vars": {"LOG_LEVEL": "debug"}}
        release.write_text("go")
        result = await asyncio.wait_for(run, 120)
        assert "env ok" in [m.content for m in result.messages]  # the actor had both keys
        supervised = json.dumps(await secret_rt.status(), default=str)  # what `loomray status --address` prints
    finally:
        secret_rt.close()
    root = Path(runtime.config.store_url.removeprefix("file://"))
    leaks = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
             and (by_name in _text(p) or by_shape in _text(p))]
    assert leaks == []
    assert "s-env" in supervised
    views = [supervised, *(_cli(root, *args) for args in (("status", "--json"), ("query", "--json")))]
    assert [i for i, text in enumerate(views) if by_name in text or by_shape in text] == []


def _cli(root: Path, *args: str) -> str:
    """What the CLI prints about the store's sessions (shared views: any user of the store may run them)."""
    from click.testing import CliRunner

    from loomray.cli.main import main

    return CliRunner().invoke(main, [*args, "--store", str(root)], catch_exceptions=False).output


def _text(path: Path) -> str:
    """An object as text; Parquet decoded (its strings may be compressed)."""
    import pyarrow.parquet as pq

    if path.suffix == ".parquet":
        return json.dumps(pq.read_table(path).to_pylist(), default=str)
    return path.read_bytes().decode("utf-8", "replace")
