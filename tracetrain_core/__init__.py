"""What every part of tracetrain computes alike: pure functions over conversations and rewards.

Below the store, the trainer and the proxy, and importing none of them (no I/O, no web framework,
no torch), so that the proxy's threading, the store's readers, the judge, the dashboard, export,
SFT and the trainer can never disagree:

- a captured call of any API as chat messages (``call_messages``, ``call_reply``, ``call_tools``),
  a message's canonical form for threading (``canonical_message``), the common prefix of sequences;
- the Responses API's and Anthropic's Messages API's conversations as chat messages, and back;
- the structured-output specification vLLM samples a chat request under (``structured_outputs``): what the
  proxy records with a constrained call and the trainer rebuilds its grammar from;
- where a command's flags take their values: the command line, ``TRACETRAIN_<FLAG>``, a configuration file
  (``apply_sources``);
- the trainer's configuration (``TrainConfig``) and the flags that make it, read by the trainer and by
  ``tracetrain serve`` alike;
- group-relative advantages (``group_advantages``; with call rewards ``call_advantages``):
  what the trainer trains on and the dashboard shows.
"""

from tracetrain_core._advantages import (
    ADVANTAGE_EPS,
    CallAdvantages,
    GroupAdvantages,
    call_advantages,
    discounted_sums,
    group_advantages,
)
from tracetrain_core._anthropic import anthropic_chat_messages, anthropic_reply
from tracetrain_core._conversation import (
    call_messages,
    call_reply,
    call_tools,
    canonical_message,
    common_prefix,
    first_choice,
    reply_message,
    same_message,
)
from tracetrain_core._flag_sources import (
    SourceError,
    apply_sources,
    env_name,
    flag_actions,
    long_flag,
    subcommand_chain,
)
from tracetrain_core._responses_api import responses_chat_messages, responses_reply
from tracetrain_core._structured import structured_outputs
from tracetrain_core._train_config import (
    LossVariant,
    SamplerCorrection,
    SamplerDType,
    TrainConfig,
    TrainDType,
    add_train_config_flags,
    train_config_from,
)

__all__ = [
    "ADVANTAGE_EPS",
    "CallAdvantages",
    "GroupAdvantages",
    "LossVariant",
    "SamplerCorrection",
    "SamplerDType",
    "SourceError",
    "TrainConfig",
    "TrainDType",
    "add_train_config_flags",
    "anthropic_chat_messages",
    "anthropic_reply",
    "apply_sources",
    "call_advantages",
    "call_messages",
    "call_reply",
    "call_tools",
    "canonical_message",
    "common_prefix",
    "discounted_sums",
    "env_name",
    "first_choice",
    "flag_actions",
    "group_advantages",
    "long_flag",
    "reply_message",
    "responses_chat_messages",
    "responses_reply",
    "same_message",
    "structured_outputs",
    "subcommand_chain",
    "train_config_from",
]
