"""The public faces of the server packages are pinned."""

from __future__ import annotations

import proxy


def test_proxy_public_names() -> None:
    assert sorted(proxy.__all__) == [
        "Declared",
        "GROUPS",
        "HANG_UP",
        "PolicyOverrides",
        "SamplingDefaults",
        "Settings",
        "create_app",
        "declared",
    ]


def test_the_serving_path_never_imports_torch() -> None:
    import subprocess
    import sys

    code = "import sys, proxy, tracetrain_cli, store; print('torch' in sys.modules, 'trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_trainer_public_names() -> None:
    import trainer

    assert sorted(trainer.__all__) == [
        "CapturedCall", "GroupAdvantages", "Learner", "LossVariant", "Sample", "SampleStats", "StepResult",
        "TrainConfig", "TrainDType", "TrainItem", "build_samples", "group_advantages", "newest_adapter", "pack",
        "policy_loss",
    ]  # fmt: skip


def test_the_proxy_subpackages_public_names() -> None:
    import importlib

    faces = {
        "proxy.admin": ["Admin", "AdminAuth", "TokenTexts"],
        "proxy.data": ["FeedbackPost", "RewardBatch", "RewardPost", "get_trajectory", "give_feedback", "list_groups",
                       "list_trajectories", "parse_feedback", "post_rewards", "review_queue", "validate_feedback"],
        "proxy.gateway": ["Forwarder", "Gate", "HANG_UP", "Key", "KeyHints", "Keyer", "NOT_AWAKE", "PolicyRegistry",
                          "RETRY_AFTER_FAILED_S", "Route", "Served", "ServedPolicy", "Signer", "Split", "Upstream",
                          "new_trajectory_id"],
        "proxy.gateway.dialects": ["CHAT", "COMPLETIONS", "ChatCompletionRequest", "ChatTranslation",
                                   "CompletionRequest", "CountTokensRequest", "DIALECTS", "Dialect", "DialectName",
                                   "MESSAGES", "MessagesRequest", "PASSTHROUGH_EVENTS", "RESPONSES",
                                   "ResponsesRequest", "StreamTranslator", "count_tokens_chat", "json_object"],
        "proxy.gateway.dialects.chat": ["CHAT", "COMPLETIONS", "ChatCompletionRequest", "CompletionRequest",
                                        "PASSTHROUGH_EVENTS"],
        "proxy.gateway.dialects.messages": ["CountTokensRequest", "MESSAGES", "MessagesRequest", "count_tokens_chat"],
        "proxy.gateway.dialects.responses": ["RESPONSES", "ResponsesRequest"],
        "proxy.gateway.upstream": ["Reply", "Router", "SSEDecoder", "Server", "ServerSentEvent", "UPSTREAM_STATES",
                                   "Upstream", "UpstreamStream", "upstream_http_error"],
        "proxy.judge": ["DEFAULT_RUBRIC", "Judge", "JudgeFailed", "JudgePrompt", "JudgeService", "Score",
                        "build_prompt"],
        "proxy.observability": ["Exporters", "Metrics", "start_exporters"],
        "proxy.training": ["Canary", "CanaryConfig", "HandoverCoordinator", "JobScheduler", "PublishError",
                           "Publisher"],
    }  # fmt: skip
    for name, exported in faces.items():
        assert sorted(importlib.import_module(name).__all__) == exported, name


def test_store_public_names() -> None:
    import store

    assert sorted(store.__all__) == [
        "ADAPTER_FIELDS", "AdapterFile", "AdapterFiles", "AdapterState", "Adapters", "ArmTotals",
        "COMPACT_COLUMNS", "Call", "CallWrite", "DRIVER_ERRORS", "DueRule", "EVALUATION_FIELDS", "Evaluations",
        "ExportFilter", "ExportPage", "ExportReads",
        "FILE_NAME_PATTERN", "FULL_DISK", "FileEntry",
        "GROUP_VIEW_STATES", "GpuHandover", "GroupArms", "GroupCalls", "GroupChanged", "GroupRecord",
        "GroupState", "Guards", "JOB_FIELDS", "JUDGEMENT_STATES", "JobState", "Jobs", "Judgements", "KeyTaken", "MOVES",
        "POLICY_NAME_PATTERN", "Policies", "PolicyAdded", "PolicyState", "PruneReport", "PruneRule", "REWARD_SOURCES",
        "Reads", "RecordRefused", "RewardIn", "RewardRecord", "RewardSummary", "RewardTimeouts", "RewardedTrajectory",
        "SchemaTooNew", "Sessions", "Store", "StoreError", "StoreFull", "StoreUnavailable", "StoredCall",
        "TRAINING_FIELDS", "TRIAL_FIELDS", "TrainingState", "TrajectoryFilter", "TrajectoryRecord", "TransitionRefused",
        "TrialState", "TrialUnit", "Trials", "UnknownCalls", "UnknownTrajectories", "allowed", "connect",
        "is_disk_full", "redact", "store_error_of", "without_userinfo",
    ]  # fmt: skip


def test_the_pure_core_public_names() -> None:
    import tracetrain_core

    assert sorted(tracetrain_core.__all__) == [
        "ADVANTAGE_EPS", "CallAdvantages", "GroupAdvantages", "LossVariant", "SamplerCorrection", "SamplerDType",
        "SourceError", "TrainConfig", "TrainDType", "add_train_config_flags", "anthropic_chat_messages",
        "anthropic_reply", "apply_sources", "call_advantages", "call_messages", "call_reply", "call_tools",
        "canonical_message", "common_prefix", "discounted_sums", "env_name", "first_choice", "flag_actions",
        "group_advantages", "long_flag", "reply_message", "responses_chat_messages", "responses_reply",
        "same_message", "structured_outputs", "subcommand_chain", "train_config_from",
    ]  # fmt: skip


def test_the_pure_core_loads_nothing_of_the_server_torch_or_a_web_framework() -> None:
    import subprocess
    import sys

    modules = ("store", "proxy", "trainer", "sqlalchemy", "torch", "starlette")
    code = f"import sys, tracetrain_core; print(*(m in sys.modules for m in {modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 6


def test_the_trainer_worker_loads_neither_the_proxy_nor_a_web_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trainer._worker, trainer.__main__; "
        "print(*(m in sys.modules for m in ('proxy', 'fastapi', 'starlette', 'prometheus_client')))"
    )  # (transformers loads jinja2 for chat templates: that one is not the dashboard's)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 4


def test_the_store_loads_neither_torch_nor_a_web_framework() -> None:
    import subprocess
    import sys

    modules = ("torch", "fastapi", "starlette", "proxy", "trainer")
    code = f"import sys, store; print(*(m in sys.modules for m in {modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 5


def test_the_command_line_and_the_child_process_helper_public_names() -> None:
    import tracetrain_cli
    import tracetrain_proc
    from store import schema

    assert sorted(tracetrain_cli.__all__) == ["VLLMLaunch", "VLLMProcess", "VLLMStartError", "main"]
    assert sorted(tracetrain_proc.__all__) == ["ChildExited", "ChildProcess"]
    assert sorted(schema.__all__) == ["LEGACY", "Upgrade", "current_revision", "head", "revisions", "upgrade"]
