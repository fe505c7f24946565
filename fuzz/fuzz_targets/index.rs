#![no_main]
libfuzzer_sys::fuzz_target!(|input: umbp_fuzz::index::Input| umbp_fuzz::index::run(input));
