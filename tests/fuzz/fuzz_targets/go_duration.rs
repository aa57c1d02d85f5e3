#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| proxy_agent::fuzz::go_duration(data));
