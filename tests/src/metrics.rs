//! The pool's Prometheus endpoint as the tests read it: a free port to serve it on, one
//! plain HTTP GET, and one sample's value out of the text format.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A TCP port nothing listens on right now (for `--metrics-addr 127.0.0.1:PORT`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` on 127.0.0.1:`port`: the response's head and body.
pub fn http_get(port: u16, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("http response");
    (head.to_string(), body.to_string())
}

/// Value of the sample `series` (name with labels, exactly as printed) in Prometheus text.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}
