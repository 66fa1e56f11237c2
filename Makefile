# The two quick-start commands (README) and a few conveniences.
.PHONY: demo test check lint bench bench-quick figures kafka-up kafka-down compose compose-down

demo:        ## set everything up, start the local Kafka, run the CPU demo
	bash scripts/demo.sh

test:        ## set up, start the local Kafka, run lint and the whole test suite
	bash scripts/test.sh

check:       ## the fast tier: lint and the unit tests (no broker), a few minutes
	bash scripts/check.sh

lint:
	$$(bash scripts/env.sh)/bin/ruff check astraflow astraflow_cli stream_apps trainers tests bench scripts

# The headline benchmarks (scripts/figures.py lists them and their commands); B=NAME runs one.
bench:       ## the full runs behind the figures: bench/results/NAME.json, then README's and docs/benchmarks.md's figures
	$$(bash scripts/env.sh)/bin/python scripts/figures.py run $(B)

bench-quick: ## every headline benchmark's --quick form: bench/results/quick/NAME.json, then prints their figures
	$$(bash scripts/env.sh)/bin/python scripts/figures.py run --quick $(B)

figures:     ## regenerate the figures of README.md and docs/benchmarks.md from bench/results/*.json
	$$(bash scripts/env.sh)/bin/python scripts/figures.py write

kafka-up:
	$$(bash scripts/env.sh)/bin/astraflow kafka up

kafka-down:
	$$(bash scripts/env.sh)/bin/astraflow kafka down

compose:     ## the docker-compose stack on this machine: engine, images, up (README "Deploy with docker-compose")
	bash scripts/compose.sh

compose-down:
	bash scripts/compose.sh down
