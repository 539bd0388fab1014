"""Adopting a winner: the explored session continues in place from the winning branch (docs/exploration.md).

The new checkpoint builds on the winner's chain (pinned for the session), so it adds a few hundred bytes,
not a copy of the transcript. Its id is stored before it is written, so a driver that dies in between
writes that same checkpoint on continuing; writing it takes the session's lease, fencing a run elsewhere.
"""

from __future__ import annotations

from loomray.checkpoint_format import ChainEncoder, load_checkpoint
from loomray.errors import CheckpointNotFound
from loomray.fencing import fence_session
from loomray.records import Checkpoint
from loomray.session_store import SessionStore
from loomray.storage import CheckpointInfo


def adopt_winner(store: SessionStore, session_id: str, user_id: str | None, winner: str, checkpoint_id: str, *,
                 agent_id: str, keep: int, owner: str) -> str:
    """Write checkpoint ``checkpoint_id`` of ``session_id`` from ``winner``'s latest one (once); return its id."""
    if any(r.checkpoint_id == checkpoint_id for r in store.checkpoints.list(session_id, user_id=user_id, limit=None)):
        return checkpoint_id
    rows = store.checkpoints.list(winner, user_id=user_id, limit=1)
    if not rows:
        raise CheckpointNotFound(f"winning branch {winner!r} has no checkpoint to adopt")
    base = store.checkpoints.list(session_id, user_id=user_id, limit=1)
    lease = fence_session(store, session_id, user_id, owner=owner)
    store.checkpoints.pin(winner, rows[0].checkpoint_id, user_id=user_id, dependent=session_id)
    src = load_checkpoint(store, winner, rows[0].checkpoint_id, user_id=user_id, pinned_for=session_id)
    if src is None:
        raise CheckpointNotFound(f"winning branch {winner!r}: checkpoint {rows[0].checkpoint_id!r} is gone")
    ckpt = Checkpoint(session_id=session_id, checkpoint_id=checkpoint_id, user_id=user_id, agent_id=agent_id,
                      turn=src.turn, position=src.position, execution_status="completed",
                      parent_checkpoint_id=base[0].checkpoint_id if base else None, forked_from=winner,
                      epoch=lease.epoch, message_count=len(src.messages), cumulative_usage=src.cumulative_usage,
                      messages=list(src.messages))
    chain = src._chain.rebased(winner, session_id) if src._chain is not None else None
    encoded = ChainEncoder(chain).encode(ckpt)
    u = ckpt.cumulative_usage
    info = CheckpointInfo(session_id=session_id, checkpoint_id=checkpoint_id, user_id=user_id, turn=ckpt.turn,
                          created_at=ckpt.created_at, position=ckpt.position, execution_status="completed",
                          message_count=len(ckpt.messages), input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                          cost_usd=u.cost_usd, spend_usd=0.0, parent_checkpoint_id=ckpt.parent_checkpoint_id,
                          forked_from=winner, agent_id=agent_id, chain=encoded.chain)
    log = store.checkpoints.log(lease, keep=keep)
    log.put(encoded.body, info)
    log.flush()
    return checkpoint_id
