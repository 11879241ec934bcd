"""Starts the test-only kernel builds (``native_builds``) that the selected tests will need as
soon as collection ends, at the lowest CPU priority: they compile on cores the earlier tests
leave idle instead of in the tests' own time."""

import os
import shutil


def pytest_collection_finish(session):
    from kvserve.ops import library
    from tests.ops import native_builds

    if shutil.which(os.environ.get("CC", "cc")) is None or os.environ.get(library.EXTRA_CFLAGS_ENV):
        return  # no compiler, or a sanitizer run (its tests load one build, made beforehand)
    if os.environ.get("KVSERVE_NATIVE") == "0":
        return
    names = {item.nodeid.split("::")[-1].split("[")[0] for item in session.items}
    plan: list[tuple[str, tuple[str, ...]]] = []
    if "test_every_kernel_compiles_with_all_warnings_as_errors" in names:
        plan += [(flags, ()) for flags in native_builds.WERROR_FLAGS.values()]
    if "test_kernel_tests_pass_on_the_avx2_build" in names:
        plan.append((native_builds.WERROR_FLAGS["x86-64-v3"], ()))
    if (
        "test_kernel_tests_pass_under_address_and_undefined_sanitizers" in names
        and native_builds.asan_preload()
    ):
        plan.append((native_builds.SANITIZE, ()))
    if "test_act8_fallback_builds_equal_the_reference" in names:
        plan += [(flags, ("quant_gemm.c",)) for flags in native_builds.ACT8_FALLBACK_FLAGS.values()]
    if plan:
        native_builds.start_background(plan)
