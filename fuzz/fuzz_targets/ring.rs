#![no_main]
libfuzzer_sys::fuzz_target!(|input: umbp_fuzz::ring::Input| umbp_fuzz::ring::run(input));
