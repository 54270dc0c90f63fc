#!/usr/bin/env python3
"""Writes fuzz seed corpora from the reference capture: every CLC message (TCP payloads), every
LLC and CDC message (SEND payloads) and every RoCE v2 UDP payload. Usage: fuzz_seeds.py OUTDIR"""
import os
import struct
import sys

out = sys.argv[1]
pcap = os.path.join(os.path.dirname(__file__), "..", "testdata", "smcr-v2-kernel-6.12-rxe.pcap")
data = open(pcap, "rb").read()
at, n = 24, 0
seeds = {"clc_message": [], "llc_message": [], "cdc_message": [], "roce_packet": []}
while at + 16 <= len(data):
    incl = struct.unpack("<I", data[at + 8:at + 12])[0]
    f = data[at + 16:at + 16 + incl]
    at += 16 + incl
    ip = f[14:]
    ihl = (ip[0] & 15) * 4
    ip = ip[:struct.unpack("!H", ip[2:4])[0]]
    l4 = ip[ihl:]
    if ip[9] == 6:
        p = l4[(l4[12] >> 4) * 4:]
        if p:
            seeds["clc_message"].append(p)
    elif ip[9] == 17 and struct.unpack("!H", l4[2:4])[0] == 4791:
        roce = l4[8:]
        seeds["roce_packet"].append(roce)
        if roce[0] == 0x04:
            pad = (roce[1] >> 4) & 3
            payload = roce[12:len(roce) - 4 - pad]
            seeds["cdc_message" if payload[0] == 0xFE else "llc_message"].append(payload)
# Bundles (our engines' datagrams of several packets, rdma::wire::parse_bundle): the
# capture's first two SENDs, made one datagram for their QP, flagged unchecked.
sends = [r for r in seeds["roce_packet"] if r[0] == 0x04][:2]
if len(sends) == 2 and sends[0][5:8] == sends[1][5:8]:
    b = bytearray([0xC0, 0, 0, 0, 0x01]) + sends[0][5:8] + bytes(4)
    for r in sends:
        r = bytearray(r)
        r[4] |= 0x03
        r[-4:] = bytes(4)
        b += struct.pack("!H", len(r)) + r
    seeds["roce_packet"].append(bytes(b))
for target, items in seeds.items():
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    for i, s in enumerate(dict.fromkeys(items)):
        open(os.path.join(d, f"capture-{i:03}"), "wb").write(s)
    print(f"{target}: {len(set(items))} seeds")
