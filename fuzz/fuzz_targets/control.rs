#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| umbp_fuzz::control::run(data));
