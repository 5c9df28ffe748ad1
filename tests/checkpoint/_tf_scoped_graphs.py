"""TF1 graphs whose optimizers ran in scopes, or two of one kind (a GAN): write, continue, restore.

    python tests/checkpoint/_tf_scoped_graphs.py write LAYOUT FOLDER STEPS      # STEPS, save, STEPS more
    python tests/checkpoint/_tf_scoped_graphs.py restore LAYOUT FOLDER STEPS K  # torch.ckpt, STEPS from K

Prints the gradients fed and every variable's final value as JSON. Runs under TensorFlow only.
"""

import json
import sys

import numpy as np


def main() -> None:
    import tensorflow.compat.v1 as tf  # (imported here: pytest's doctest collection imports this file)

    tf.disable_eager_execution()
    mode, layout, folder, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rng = np.random.default_rng(0)
    grads = {v: rng.normal(size=(12, 2, 3)) for v in ("g/w", "d/w")}
    variables = ["g/w", "d/w"] if layout.startswith("gan") else ["g/w"]

    with tf.Graph().as_default(), tf.Session() as sess:
        feeds, pairs, ops = {}, [], []
        for i, name in enumerate(variables):
            scope, var_name = name.split("/")
            with tf.variable_scope(scope):
                var = tf.get_variable(var_name, initializer=np.linspace(-1.0, 1.0, 6).reshape(2, 3) + i)
            feeds[name] = tf.placeholder(tf.float64, (2, 3))
            pairs.append((scope, feeds[name], var))
        if layout == "gan_one_scope":  # one variable scope: the second Adam's beta powers are _1
            with tf.variable_scope("train"):
                ops = [tf.train.AdamOptimizer(0.1).apply_gradients([(g, var)]) for _, g, var in pairs]
        for scope, g, var in pairs if not ops else ():
            opt = tf.train.AdamOptimizer(0.1)
            if layout == "variable":
                with tf.variable_scope("train"):
                    ops.append(opt.apply_gradients([(g, var)]))
            elif layout == "name":
                with tf.name_scope("train"):
                    ops.append(opt.apply_gradients([(g, var)]))
            elif layout == "gan":
                with tf.variable_scope(f"{scope}_train"):
                    ops.append(opt.apply_gradients([(g, var)]))
            else:  # gan_suffix: the second Adam's beta powers are beta1_power_1
                ops.append(opt.apply_gradients([(g, var)]))
        step_op = tf.group(*ops)
        saver = tf.train.Saver()
        sess.run(tf.global_variables_initializer())
        start = 0
        if mode == "write":
            for k in range(steps):
                sess.run(step_op, {feeds[v]: grads[v][k] for v in variables})
            saver.save(sess, f"{folder}/tf.ckpt")
            start = steps
        else:
            saver.restore(sess, f"{folder}/torch.ckpt")
            start = int(sys.argv[5])
        for k in range(start, start + steps):
            sess.run(step_op, {feeds[v]: grads[v][k] for v in variables})
        out = {v.op.name: sess.run(v).tolist() for v in tf.global_variables()}
        print(json.dumps({"grads": {v: grads[v].tolist() for v in variables}, "finals": out}))


if __name__ == "__main__":
    main()
