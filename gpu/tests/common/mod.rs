//! Helpers for tests that need a real second process: the test binary re-executes itself
//! to run one "child" test function, and the two talk over the child's stdin/stdout.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use umbp_gpu::MemoryRegistration;

/// Set in the environment of a re-executed test binary; child entry points do nothing
/// without it, so they pass trivially in a normal run.
pub const CHILD_ENV: &str = "UMBP_GPU_TEST_CHILD";

pub fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

pub struct Peer {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    /// Runs test `entry` of this same binary in a new process.
    pub fn spawn(entry: &str) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let mut child = Command::new(exe)
            .args([entry, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child test process");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Peer {
            child,
            stdin,
            stdout,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What follows `prefix` on the next line of the child that has it (libtest prints its
    /// own text around ours).
    pub fn expect(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("read child stdout");
            assert!(n > 0, "child exited before printing {prefix:?}");
            // libtest may print "test name ... " in front of the child's first line.
            let tag = format!("{prefix} ");
            if let Some(at) = line.find(&tag) {
                return line[at + tag.len()..].trim().to_string();
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to child");
        self.stdin.flush().unwrap();
    }

    /// Asks the child to check its buffer against pattern `seed`.
    pub fn verify(&mut self, seed: u8) -> String {
        self.send(&format!("verify {seed}"));
        self.expect("RESULT")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Child side: reads commands from stdin until EOF or `exit`; `verify <seed>` calls
/// `check(seed)` and prints `RESULT <its answer>`.
pub fn serve(mut check: impl FnMut(u8) -> String) {
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("verify") => {
                let seed: u8 = words.next().unwrap().parse().unwrap();
                println!("RESULT {}", check(seed));
            }
            Some("exit") | None => return,
            Some(other) => panic!("unknown command {other}"),
        }
    }
}

/// Byte `i` of test pattern `seed`: varies with both so a shifted or stale copy shows.
pub fn pattern(seed: u8, i: usize) -> u8 {
    (i as u32)
        .wrapping_mul(2_654_435_761)
        .rotate_left(seed as u32 % 32)
        .wrapping_add(seed as u32) as u8
        ^ (i >> 12) as u8
}

pub fn fill(buf: &mut [u8], seed: u8) {
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = pattern(seed, i));
}

/// `OK`, or the first mismatching index.
pub fn check(buf: &[u8], seed: u8) -> String {
    match buf
        .iter()
        .enumerate()
        .position(|(i, &b)| b != pattern(seed, i))
    {
        None => "OK".into(),
        Some(i) => format!("BAD at {i}: {} != {}", buf[i], pattern(seed, i)),
    }
}

pub fn reg_to_hex(reg: &MemoryRegistration) -> String {
    bytemuck::bytes_of(reg)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn reg_from_hex(hex: &str) -> MemoryRegistration {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    bytemuck::pod_read_unaligned(&bytes)
}

/// Page-aligned anonymous memory standing in for pool DRAM.
pub struct PoolMem {
    ptr: *mut u8,
    len: usize,
}

impl PoolMem {
    pub fn new(len: usize) -> PoolMem {
        // SAFETY: a fresh private anonymous mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        PoolMem {
            ptr: ptr.cast(),
            len,
        }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as self, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PoolMem {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in new.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
