#![no_main]
libfuzzer_sys::fuzz_target!(|input: umbp_fuzz::sqe::Input| umbp_fuzz::sqe::run(input));
