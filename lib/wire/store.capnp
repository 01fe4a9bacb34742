# The rendezvous store a server hosts for a job spread over servers (a session's HostStore):
# the job's servers meet there to set up their process groups, as c10d's Store API describes.
# One message per frame (rgpu/net/Frame.h).
#
# A connection opens with StoreChallenge (from the store), StoreHello (from the joining server)
# and StoreWelcome (from the store): each side proves it holds the job's secret, which the
# HostStore reply gave and which never travels again. Everything after the StoreWelcome is
# sealed (rgpu/net/Seal.h) under keys derived from the secret and both nonces: StoreRequest
# frames, each answered by one StoreReply.

@0xc2477273617f91aa;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("rgpu::wire");

struct StoreChallenge {
  version @0 :UInt32;    # of this protocol, 1; a joining server of another version is refused
  nonce @1 :Data;        # 32 random bytes
}

struct StoreHello {
  nonce @0 :Data;        # 32 random bytes of the joining server
  mac @1 :Data;          # HMAC-SHA-256 under the secret of both nonces (rgpu/net/Auth.h)
}

struct StoreWelcome {
  mac @0 :Data;          # the store's own proof, under another label
}

struct StoreRequest {
  union {
    set @0 :StoreEntry;
    get @1 :Data;        # a key; answered with its value, or missing
    add @2 :StoreAdd;    # answered with the new number
    check @3 :List(Data); # answered with whether every key is set
    wait @4 :StoreWait;  # answered (ok) once every key is set, or missing after timeoutMs
    deleteKey @5 :Data;  # answered with whether the key was set
    numKeys @6 :Void;
    compareSet @7 :StoreCompareSet; # answered with the key's value after it
    append @8 :StoreEntry;
  }
}

struct StoreEntry {
  key @0 :Data;
  value @1 :Data;
}

struct StoreAdd {
  key @0 :Data;          # its value is a decimal number, as c10d's TCPStore keeps it
  delta @1 :Int64;
}

struct StoreWait {
  keys @0 :List(Data);
  timeoutMs @1 :UInt32;  # at most 1000: a longer wait is a loop of these
}

struct StoreCompareSet {
  key @0 :Data;
  expected @1 :Data;     # set only if the key holds this (an empty one: only if it is unset)
  desired @2 :Data;
}

struct StoreReply {
  union {
    ok @0 :Void;
    value @1 :Data;
    number @2 :Int64;
    flag @3 :Bool;
    missing @4 :Void;
    error @5 :Text;      # the request was refused (a limit); the connection goes on
  }
}
