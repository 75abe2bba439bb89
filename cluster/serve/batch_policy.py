"""The scheduling policy a Serve replica runs when its configuration names none.

Every OpenAI app serves the Batch API, whose lines carry `BATCH_PRIORITY` added to their
priority. Only the priority policy orders the engine's waiting queue by priority (smallest
(priority, arrival time) first; equal priorities keep arrival order, as under FCFS), so a chat
request is admitted before the batch lines still waiting. A configuration that sets
`scheduling_policy` keeps its choice.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BATCH_SCHEDULING_POLICY = "priority"
_logged = False


def batch_scheduling_policy() -> str:
    """The default policy of a Serve replica's engine (logged once per process)."""
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "scheduling_policy: %s (the default of a Serve app: batch lines wait behind "
            "interactive requests; set scheduling_policy to choose)",
            BATCH_SCHEDULING_POLICY,
        )
    return BATCH_SCHEDULING_POLICY
