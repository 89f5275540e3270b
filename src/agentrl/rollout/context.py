"""Context strategies for a conversation that outgrew ``--max_prompt_tokens`` (``--new_context``).

* ``discard_all_tools``: drop every tool message, then the oldest remaining turns beyond the last ten, keeping the
  system prompt and the question;
* ``discard_all``: replace the whole history by an assistant message summarising it, written by the summariser
  models of the agent config (``browse_agent``, ordered fail-over); if none answers, fall back to
  ``discard_all_tools``.

Either way the next prompt is no longer an extension of the previous one, so a new branch starts.
"""

from __future__ import annotations

import logging
from typing import Any

from agentrl.rollout.conversation import TokenConversation
from agentrl.scoring.agent_config import AgentConfig
from agentrl.scoring.llm import LLMUnavailableError, chat_with_failover

logger = logging.getLogger(__name__)

KEEP_RECENT = 10
SUMMARY_PROMPT = (
    "Summarise the work so far on the task below for the agent that will continue it: the actions taken, the "
    "results obtained (with exact numbers and facts), and the current status. Use concise Markdown."
)


def discard_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System prompt and question, then the last ``KEEP_RECENT`` non-tool messages."""
    head = [m for m in messages[:2] if m["role"] in ("system", "user")]
    rest = [m for m in messages[len(head):] if m["role"] != "tool"]
    return head + rest[-KEEP_RECENT:]


async def summarise(messages: list[dict[str, Any]], query: str, agent_config: AgentConfig) -> str:
    """A summary of the conversation by the ``browse_agent`` models; raises ``LLMUnavailableError``."""
    settings = agent_config.browse_agent
    if settings is None:
        raise LLMUnavailableError(["no browse_agent (summariser) section in the agent config"])
    history = "\n\n".join(
        f"[{m.get('name') or m['role']}] {m.get('content') or ''}" for m in messages[2:] if m["role"] != "system")
    summary, _model = await chat_with_failover(
        settings,
        [{"role": "system", "content": SUMMARY_PROMPT},
         {"role": "user", "content": f"Task: {query}\n\nHistory:\n{history}"}],
        str.strip)
    return summary


async def reset_context(conversation: TokenConversation, strategy: str, query: str,
                        agent_config: AgentConfig) -> None:
    """Shrink the conversation with ``strategy`` and start a new branch."""
    messages = conversation.messages
    if strategy == "discard_all":
        try:
            summary = await summarise(messages, query, agent_config)
            conversation.restart([*messages[:2], {"role": "assistant", "content": summary}])
            return
        except LLMUnavailableError as error:
            logger.warning("context summary failed (%s); discarding tool messages instead", error)
    conversation.restart(discard_tools(messages))
