"""Which tests are slow: ``make test`` runs the rest (``-m "not slow"``, on parallel workers),
``make test-slow`` these (CI runs both).

A test is slow when it trains whole runs (trainer runs, Ray / Flower simulations, SIGKILL
crash tests, sweeps of many settings, statistical audits with many trials): each of them takes
10 s or more of one core, and together they are about half the suite's time. They are listed
here, by test function (every parametrisation) or by module, so that one place says what the
fast suite leaves out; a docs example that runs a trainer (``privkit train``/``demo``/
``report``/``audit``) is slow too.
"""

from __future__ import annotations

import pytest

#: Whole modules whose every test is a long run.
SLOW_MODULES = {
    "tests/fl_examples/flower/test_example_app.py",
    "tests/fl_examples/flower/test_flower_adapters.py",
    "tests/fl_examples/flower/test_dpsgd_simulation.py",
    "tests/fl_examples/test_dprec_resume.py",
    "tests/fl_examples/test_mapa_resume.py",
    "tests/reliability/test_crash_safety.py",
    "tests/reliability/test_no_underreport.py",
}

#: Test functions (every parametrisation): "path::name".
SLOW_TESTS = {
    "tests/coupling/test_coupling_distributed.py::test_coupling",
    "tests/coupling/test_coupling_dprec.py::test_coupling",
    "tests/coupling/test_coupling_upcycled.py::test_coupling",
    "tests/fl_examples/core/test_deep_models.py::test_loss_decreases_on_learnable_task",
    "tests/fl_examples/core/test_default_out.py::"
    "test_a_run_without_out_writes_a_new_timestamped_directory",
    "tests/fl_examples/core/test_outdir.py::test_overwrite_starts_new_ledgers_and_says_so",
    "tests/fl_examples/core/test_outdir.py::test_rerun_without_resume_is_refused_and_changes_nothing",
    "tests/fl_examples/core/test_report_plots.py::"
    "test_every_figure_names_data_seed_and_how_private",
    "tests/fl_examples/core/test_tradeoff.py::test_report_tradeoff_reads_every_trainers_run",
    "tests/fl_examples/test_dprec_modes.py::test_epsilon_calibrates_both_algorithms_to_the_target",
    "tests/fl_examples/test_dprec_modes.py::test_replace_one_is_dprecs_only_relation",
    "tests/fl_examples/test_dprec_modes.py::test_unreachable_dprec_epsilon_names_epsilon",
    "tests/fl_examples/test_mapa.py::test_ledger_charges_each_upload_once",
    "tests/fl_examples/test_mapa.py::test_poisson_amplified_run_reports_both_numbers",
    "tests/fl_examples/test_mapa_gaussian.py::"
    "test_a_run_inside_stage_0_says_so_and_draws_the_planned_stages",
    "tests/fl_examples/test_mapa_gaussian.py::"
    "test_ledger_charges_each_upload_and_dp_accounting_agrees",
    "tests/fl_examples/test_out_dir_safety.py::"
    "test_a_bad_input_with_overwrite_leaves_out_byte_identical",
    "tests/fl_examples/test_out_dir_safety.py::"
    "test_overwrite_with_discard_ledger_keeps_the_old_ledger_aside",
    "tests/fl_examples/test_private_modes.py::"
    "test_client_mode_run_charges_each_data_round_and_dp_accounting_agrees",
    "tests/fl_examples/test_private_modes.py::"
    "test_record_mode_charges_every_step_and_dp_accounting_agrees",
    "tests/fl_examples/test_release_accounting.py::"
    "test_dprec_secure_noise_draws_from_the_os_and_charges_a_replay_again",
    "tests/fl_examples/test_release_accounting.py::"
    "test_the_history_row_attack_is_no_better_than_the_stated_epsilon",
    "tests/fl_examples/test_scfl.py::test_aggregate_unbiased_monte_carlo",
    "tests/fl_examples/test_scfl.py::test_cli_and_tradeoff_on_a_noise_sweep",
    "tests/fl_examples/test_scfl.py::test_resume_is_exact",
    "tests/fl_examples/test_scfl_dp.py::test_resume_does_not_charge_twice",
    "tests/fl_examples/test_upcycled.py::test_lstm_model_trains_on_sent140_tokens",
    "tests/fl_examples/test_upcycled.py::test_resume_in_a_new_process_is_bitwise_equal",
    "tests/fl_examples/test_upcycled.py::test_same_seed_same_run_and_report",
    "tests/privkit/accountants/test_accountant.py::test_monotone_subsampled",
    "tests/privkit/accountants/test_calibration.py::"
    "test_calibrate_steps_answers_in_a_few_pricings_for_any_noise",
    "tests/privkit/accountants/test_calibration.py::test_calibrate_then_check_never_exceeds",
    "tests/privkit/accountants/test_fftpld.py::"
    "test_between_dp_accountings_optimistic_and_pessimistic_pld",
    "tests/privkit/accountants/test_relations.py::"
    "test_replace_one_is_never_below_add_remove_for_the_same_event",
    "tests/privkit/accountants/test_soundness.py::"
    "test_auto_and_calibration_fall_back_instead_of_raising",
    "tests/privkit/accountants/test_soundness.py::"
    "test_every_method_is_an_upper_bound_and_auto_is_their_minimum",
    "tests/privkit/accountants/test_soundness.py::test_monotone_in_q_on_random_settings",
    "tests/privkit/flower/test_banded.py::test_in_flowers_simulation_engine",
    "tests/privkit/flower/test_central.py::test_simulation_adds_the_noise_and_stops",
    "tests/privkit/flower/test_flower_distributed.py::test_in_flowers_simulation_engine",
    "tests/privkit/mechanisms/test_rec.py::test_decode_in_another_process_is_bit_exact",
    "tests/privkit/mechanisms/test_rec.py::test_gumbel_max_frequencies_match_softmax",
    "tests/privkit/mechanisms/test_sampling.py::test_l2_laplace_passes_battery",
    "tests/privkit/test_audit.py::test_laplace_l2_in_two_dimensions_fails_with_less_noise",
    "tests/privkit/test_audit.py::test_mechanism_with_less_noise_fails",
    "tests/privkit/test_audit.py::test_real_mechanism_passes",
    "tests/privkit/test_audit.py::test_statistic_ignores_floating_point_bits",
    "tests/privkit/test_audit_rec.py::test_0_8x_noise_mutant_fails_at_the_default_trials",
    "tests/privkit/test_audit_run_bugs.py::test_false_alarm_rate_of_the_correct_code_over_100_seeds",
    "tests/privkit/test_cli.py::test_demo_and_console_script",
    "tests/privkit/test_cli.py::test_train_upcycled_cli",
    "tests/privkit/test_cli_conventions.py::test_a_missing_extra_module_is_one_line_naming_the_extra",
    "tests/privkit/test_cli_conventions.py::test_train_quiet_turns_the_progress_bar_off",
    "tests/privkit/test_ledger_budget.py::test_heterogeneous_clients_and_events_match_tight_pricing",
    "tests/privkit/torch/test_torch_clients.py::test_batched_clients_equal_the_loop_for_other_layers",
    "tests/reliability/test_mechanism_audits.py::test_l2_laplace_mechanisms_norm_and_direction",
}

#: A docs example that runs one of these commands trains or audits a whole run.
SLOW_COMMANDS = ("privkit train", "privkit demo", "privkit report", "privkit audit")


def _is_slow(item: pytest.Item) -> bool:
    path, _, rest = item.nodeid.partition("::")
    if path in SLOW_MODULES or f"{path}::{rest.partition('[')[0]}" in SLOW_TESTS:
        return True
    if path == "tests/test_readme.py" and hasattr(item, "callspec"):
        ex = item.callspec.params.get("ex")
        return ex is not None and any(c in ex.code for c in SLOW_COMMANDS)
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
