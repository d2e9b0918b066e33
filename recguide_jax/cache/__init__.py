"""The paged KV cache (`kv_cache`: device pages and the host allocator) and the device memory plan that sizes it (`memory_plan`, `memory_report`)."""
