"""`agentrl run`: a whole run, top to bottom — database, tools or environment, tasks, held-out evaluation, warm-up,
inference, RL (samplers, trainer, live status line), final evaluation, summary — and, with ``--mode eval``, one
evaluation. Everything it starts is stopped by PID when it ends, fails or is interrupted (:mod:`.processes`)."""

from __future__ import annotations

import os

from agentrl.config_flags import comma_list
from agentrl.run import stages
from agentrl.run.config import RunConfig
from agentrl.run.processes import Processes, RunFailed, Stopped, say
from agentrl.run.stages import RunState


def train(run: RunState) -> None:
    """The RL run: the held-out evaluations of the starting, warmed-up and final model frame a warm-up and RL."""
    config = run.config
    stages.use_model(run)
    stages.use_database(run)
    if config.env:
        tasks, limit = stages.use_env(run), None
    else:
        stages.use_tools(run)
        tasks, limit = config.tasks, config.num_tasks or None
    stages.upload_tasks(run, tasks, limit)
    served = {"inference_urls": comma_list(config.sglang_urls)} if config.sglang_urls else {}
    if config.num_eval_tasks and config.val_before_train:
        stages.held_out_eval(run, "before", **served, **stages.model_flag(config.model))
    model = config.model
    if config.warmup:
        model = str(stages.warm_up(run, config.model))
        if config.sglang_urls:
            stages.load_weights(model, config.sglang_urls)
    stages.use_inference(run, model)
    if config.warmup and config.num_eval_tasks:
        stages.held_out_eval(run, "warmup", inference_urls=comma_list(run.inference_urls), model_name_or_path=model)
    stages.start_samplers(run, model)
    stages.train(run, model)
    stages.stop_samplers(run)
    if config.num_eval_tasks:
        stages.held_out_eval(run, "after", inference_urls=comma_list(run.inference_urls),
                             model_name_or_path=str(config.output_dir / "final"))
    stages.drop_published_weights(run)
    stages.report(run)
    stages.summary(run)


def evaluate(run: RunState) -> None:
    """--mode eval: `agentrl eval` of the model on the tasks, through the run's database and tools; on
    ``--sglang_urls``, else on the engine `agentrl eval` starts itself once it knows it has something to sample (a
    stored result is reused without one)."""
    stages.use_model(run)
    stages.use_database(run)
    if run.config.env:
        stages.use_env(run)
    else:
        stages.use_tools(run)
    if run.config.sglang_urls:
        stages.use_inference(run, run.config.model)
    stages.evaluate(run, run.eval_tasks or run.config.eval_tasks)


def main(config: RunConfig) -> int:
    """Run ``config`` (``--mode rl`` or ``eval``); the exit status: 0, 1 when a stage failed, 128 + the signal
    number when stopped by SIGINT, SIGTERM or SIGHUP."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    assert config.run_dir is not None
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    processes = Processes(config.run_dir / "logs")
    run = RunState(config, processes)
    try:
        with processes:
            try:
                (evaluate if config.mode == "eval" else train)(run)
            finally:
                processes.stop_all()
                stages.stop_database(run)
    except RunFailed as error:
        say(str(error))
        return 1
    except Stopped as stop:
        say(f"stopped by {stop}: every process this run started has been stopped")
        return 128 + stop.signum
    return 0
