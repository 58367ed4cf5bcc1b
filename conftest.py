# Root conftest: registers shared fixture modules (pytest only allows pytest_plugins here).
pytest_plugins = ["tests.model_fixtures", "tests.service_fixtures", "tests.budget_plugin", "tests.tier_guard"]
