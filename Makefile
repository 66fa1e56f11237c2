# The two quick-start commands (README) and a few conveniences.
.PHONY: demo test check lint bench kafka-up kafka-down compose compose-down

demo:        ## set everything up, start the local Kafka, run the CPU demo
	bash scripts/demo.sh

test:        ## set up, start the local Kafka, run lint and the whole test suite
	bash scripts/test.sh

check:       ## the fast tier: lint and the unit tests (no broker), a few minutes
	bash scripts/check.sh

lint:
	$$(bash scripts/env.sh)/bin/ruff check astraflow astraflow_cli stream_apps trainers tests bench

bench:
	for b in bench/*.py; do case $$b in */_*) ;; *) $$(bash scripts/env.sh)/bin/python $$b --quick ;; esac; done

kafka-up:
	$$(bash scripts/env.sh)/bin/astraflow kafka up

kafka-down:
	$$(bash scripts/env.sh)/bin/astraflow kafka down

compose:     ## the docker-compose stack on this machine: engine, images, up (README "Deploy with docker-compose")
	bash scripts/compose.sh

compose-down:
	bash scripts/compose.sh down
