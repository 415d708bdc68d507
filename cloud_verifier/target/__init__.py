"""The target model runner: ragged batched forward passes, the paged attention, the supported architectures, the compiled forward."""
