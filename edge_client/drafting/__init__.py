"""What drafts on the device: the drafter contract, the draft step, the ONNX runner, grammar drafting, n-gram lookup, the draft's prefill and prefix cache, the tokenizer."""
